#!/usr/bin/env bash
# Start ik_llama.cpp's llama-server on 127.0.0.1:${PORT:-8103} on the GGUF stopline serves
# ($MODEL, or the embedded SmolLM2), its weights repacked at load (-rtr), in the foreground.
# The same slots and context as start_llamacpp.sh.
set -euo pipefail
# IK_ARGS: more server flags, e.g. IK_ARGS=-no-fa (ik_llama.cpp 0.1.5's flash attention aborts
# with GGML_ASSERT(S > 0) at its first prompt on the Intel Xeon hosts, SmolLM2 and Gemma 3 alike).
source "$(dirname "$0")/common.sh"
if [[ ! -x "$IKLLAMA_SERVER" ]]; then
    echo "start_ikllamacpp.sh: $IKLLAMA_SERVER is missing: run bench/peers/setup_ikllamacpp.sh first" >&2
    exit 127
fi
PORT=${PORT:-8103}
exec "$IKLLAMA_SERVER" -m "${MODEL:-$(gguf_path)}" --host 127.0.0.1 --port "$PORT" \
    -np "${NP:-32}" -c "${CTX:-131072}" -cb --metrics -rtr \
    -t "${THREADS:-2}" --alias "${SERVED_NAME:-SmolLM2-135M-Instruct}" ${IK_ARGS:-} "$@"
