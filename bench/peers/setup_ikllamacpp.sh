#!/usr/bin/env bash
# ik_llama.cpp's llama-server and llama-bench (run-time repacking: -rtr), built with cmake from the
# tree vendored in the PyPI sdist of ik-llama-cpp-python. ~25 min on 2 cores.
set -euo pipefail
source "$(dirname "$0")/common.sh"
vendored_tree ik-llama-cpp-python "${IKLCP_VERSION:-0.1.5}" vendor/ik_llama.cpp "$IKLLAMACPP_DIR"
gen=$IKLLAMACPP_DIR/common/cmake/build-info-gen-cpp.cmake
if [[ ! -f "$gen" ]]; then
    # The sdist leaves out the script that writes common/build-info.cpp (from git, which the
    # sdist is not): write one that fills the template with the package's version.
    mkdir -p "$(dirname "$gen")"
    cat > "$gen" <<CMAKE
set(BUILD_NUMBER 0)
set(BUILD_COMMIT "ik-llama-cpp-python-${IKLCP_VERSION:-0.1.5}")
set(BUILD_COMPILER "\${CMAKE_C_COMPILER_ID} \${CMAKE_C_COMPILER_VERSION}")
set(BUILD_TARGET "$(uname -m)")
configure_file(common/build-info.cpp.in common/build-info.cpp)
CMAKE
fi
if [[ ! -x "$IKLLAMA_SERVER" || ! -x "$IKLLAMA_BENCH" ]]; then
    build_servers "$IKLLAMACPP_DIR" -DGGML_NATIVE=ON
fi
"$IKLLAMA_SERVER" --version 2>&1 | head -2
echo "== ik_llama.cpp's llama-server ready: bench/peers/start_ikllamacpp.sh"
