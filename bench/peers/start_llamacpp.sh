#!/usr/bin/env bash
# Start llama-server on 127.0.0.1:${PORT:-8102} on the same GGUF stopline serves (foreground):
# $MODEL, or the embedded SmolLM2.
# 32 parallel slots with continuous batching; -c is shared by the slots (4,096 tokens each).
# --metrics exposes llamacpp:* counters; --slots lets the bench read per-slot state.
set -euo pipefail
# LLAMACPP_ARGS: more server flags (ik_llama.cpp's script reads IK_ARGS, so one bench run can
# give each peer its own).
source "$(dirname "$0")/common.sh"
if [[ ! -x "$LLAMA_SERVER" ]]; then
    echo "start_llamacpp.sh: $LLAMA_SERVER is missing: run bench/peers/setup_llamacpp.sh first (log: \$PEERS_DIR/setup_llamacpp.log)" >&2
    exit 127
fi
PORT=${PORT:-8102}
exec "$LLAMA_SERVER" -m "${MODEL:-$(gguf_path)}" --host 127.0.0.1 --port "$PORT" \
    -np "${NP:-32}" -c "${CTX:-131072}" -cb --metrics --slots \
    -t "${THREADS:-2}" --alias "${SERVED_NAME:-SmolLM2-135M-Instruct}" ${LLAMACPP_ARGS:-} "$@"
