# Shared paths of the peer scripts (sourced, not run). Installs live outside the repo tree.
PEERS_DIR=${STOPLINE_PEERS_DIR:-/work/peers}
REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
# The Python that has stopline installed (used to locate and export the model).
STOPLINE_PYTHON=${STOPLINE_PYTHON:-python}
HF_DIR=$PEERS_DIR/hf-smollm2
VLLM_VENV=$PEERS_DIR/vllm-venv
LLAMACPP_DIR=$PEERS_DIR/llama.cpp
LLAMA_SERVER=$LLAMACPP_DIR/build/bin/llama-server
LLAMA_BENCH=$LLAMACPP_DIR/build/bin/llama-bench
IKLLAMACPP_DIR=$PEERS_DIR/ik_llama.cpp
IKLLAMA_SERVER=$IKLLAMACPP_DIR/build/bin/llama-server
IKLLAMA_BENCH=$IKLLAMACPP_DIR/build/bin/llama-bench
mkdir -p "$PEERS_DIR"

gguf_path() {
    "$STOPLINE_PYTHON" -c 'from stopline.model.loaders.loader import default_model_path; print(default_model_path())'
}
