#!/usr/bin/env bash
# llama.cpp's llama-server and llama-bench, built with cmake from the llama.cpp tree vendored in the PyPI sdist
# of llama-cpp-python (the only registry that carries its source). ~15 min on 2 cores.
set -euo pipefail
source "$(dirname "$0")/common.sh"
LCP_VERSION=${LCP_VERSION:-0.3.36}
JOBS=${JOBS:-2}

if [[ ! -d "$LLAMACPP_DIR" ]]; then
    echo "== downloading the llama-cpp-python $LCP_VERSION sdist"
    tmp=$(mktemp -d)
    pip download -q --no-binary :all: --no-deps -d "$tmp" "llama-cpp-python==$LCP_VERSION"
    tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
    mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$LLAMACPP_DIR"
    rm -rf "$tmp"
fi
if [[ ! -x "$LLAMA_SERVER" || ! -x "$LLAMA_BENCH" ]]; then
    echo "== building llama-server and llama-bench (nice 19, -j$JOBS)"
    cd "$LLAMACPP_DIR"
    cpu_flags=(-DGGML_NATIVE=ON)
    if grep -q amx_tile /proc/cpuinfo; then
        # -march=native on an AMX host builds ggml's tile code, which dies at its first tile
        # instruction here (SIGILL at tilezero, SIGSEGV at ldtilecfg): name the ISA instead.
        cpu_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                   -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
                   -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
    fi
    nice -n 19 cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "${cpu_flags[@]}"
    nice -n 19 cmake --build build -j"$JOBS" --target llama-server llama-bench
fi
"$LLAMA_SERVER" --version 2>&1 | head -2
echo "== llama-server ready: bench/peers/start_llamacpp.sh"
