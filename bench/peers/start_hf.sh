#!/usr/bin/env bash
# HF transformers `generate` (one prompt at a time) behind a minimal OpenAI API, on
# 127.0.0.1:${PORT:-8103}, serving the HF directory setup_vllm.sh exports (foreground).
set -euo pipefail
source "$(dirname "$0")/common.sh"
if [[ ! -f "$HF_DIR/model.safetensors" ]]; then
    "$STOPLINE_PYTHON" -c "import sys; from stopline.model.loaders.loader import export_hf_dir, load_model; export_hf_dir(load_model(None), sys.argv[1])" "$HF_DIR"
fi
exec "$STOPLINE_PYTHON" "$(dirname "$0")/hf_server.py" --model "$HF_DIR" "$@"
