#!/usr/bin/env bash
# ik_llama.cpp's llama-server and llama-bench (run-time repacking: -rtr), built with cmake from the
# tree vendored in the PyPI sdist of ik-llama-cpp-python (the index carries no other copy of its
# source). ~25 min on 2 cores.
set -euo pipefail
source "$(dirname "$0")/common.sh"
IKLCP_VERSION=${IKLCP_VERSION:-0.1.5}
JOBS=${JOBS:-2}

if [[ ! -d "$IKLLAMACPP_DIR" ]]; then
    echo "== downloading the ik-llama-cpp-python $IKLCP_VERSION sdist"
    tmp=$(mktemp -d)
    pip download -q --no-binary :all: --no-deps -d "$tmp" "ik-llama-cpp-python==$IKLCP_VERSION"
    tar -xzf "$tmp"/ik_llama_cpp_python-*.tar.gz -C "$tmp"
    mv "$tmp"/ik_llama_cpp_python-*/vendor/ik_llama.cpp "$IKLLAMACPP_DIR"
    rm -rf "$tmp"
fi
if [[ ! -x "$IKLLAMA_SERVER" || ! -x "$IKLLAMA_BENCH" ]]; then
    echo "== building ik_llama.cpp's llama-server and llama-bench (nice 19, -j$JOBS)"
    cd "$IKLLAMACPP_DIR"
    nice -n 19 cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DGGML_NATIVE=ON
    nice -n 19 cmake --build build -j"$JOBS" --target llama-server llama-bench
fi
"$IKLLAMA_SERVER" --version 2>&1 | head -2
echo "== ik_llama.cpp's llama-server ready: bench/peers/start_ikllamacpp.sh"
