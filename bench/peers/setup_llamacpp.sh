#!/usr/bin/env bash
# llama.cpp's llama-server and llama-bench, built with cmake from the llama.cpp tree vendored in the PyPI sdist
# of llama-cpp-python (the only registry that carries its source). ~15 min on 2 cores.
set -euo pipefail
source "$(dirname "$0")/common.sh"
vendored_tree llama-cpp-python "${LCP_VERSION:-0.3.36}" vendor/llama.cpp "$LLAMACPP_DIR"
if [[ ! -x "$LLAMA_SERVER" || ! -x "$LLAMA_BENCH" ]]; then
    cpu_flags=(-DGGML_NATIVE=ON)
    if grep -q amx_tile /proc/cpuinfo; then
        # -march=native on an AMX host builds ggml's tile code, which dies at its first tile
        # instruction here (SIGILL at tilezero, SIGSEGV at ldtilecfg): name the ISA instead.
        cpu_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                   -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
                   -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
    fi
    build_servers "$LLAMACPP_DIR" -DLLAMA_BUILD_EXAMPLES=OFF "${cpu_flags[@]}"
fi
"$LLAMA_SERVER" --version 2>&1 | head -2
echo "== llama-server ready: bench/peers/start_llamacpp.sh"
