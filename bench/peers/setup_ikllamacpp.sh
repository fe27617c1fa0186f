#!/usr/bin/env bash
# ik_llama.cpp's llama-server and llama-bench (run-time repacking: -rtr), built with cmake from the
# tree vendored in the PyPI sdist of ik-llama-cpp-python. ~25 min on 2 cores.
set -euo pipefail
source "$(dirname "$0")/common.sh"
vendored_tree ik-llama-cpp-python "${IKLCP_VERSION:-0.1.5}" vendor/ik_llama.cpp "$IKLLAMACPP_DIR"
if [[ ! -x "$IKLLAMA_SERVER" || ! -x "$IKLLAMA_BENCH" ]]; then
    build_servers "$IKLLAMACPP_DIR" -DGGML_NATIVE=ON
fi
"$IKLLAMA_SERVER" --version 2>&1 | head -2
echo "== ik_llama.cpp's llama-server ready: bench/peers/start_ikllamacpp.sh"
