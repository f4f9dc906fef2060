#!/usr/bin/env bash
# The GQA-replication matrix (vLLM issue #45330): per TP pair, the regime, the
# predicted and observed handshake outcome and a verdict; then one line per vLLM
# version saying whether #45330 reproduces. Exit 0 when every pair that ran did
# what configs/gqa_replication.yaml expects of that version.
#
#   MODEL=<id or hub id>  TP_P=<n>  TP_D=<n>  ONLY=<id,id>  DEVICE=cpu|gpu
#   VLLM_VERSION=0.21.0[,0.32.0]   each version runs from its own .venvs/ environment
# Extra arguments go to `python -m harness matrix` (e.g. --list).
set -euo pipefail
cd "$(dirname "$0")"
DEVICE="${DEVICE:-}" bash scripts/setup.sh
args=(configs/gqa_replication.yaml)
[ -n "${MODEL:-}" ] && args+=(--model "$MODEL")
[ -n "${TP_P:-}" ] && args+=(--tp-p "$TP_P")
[ -n "${TP_D:-}" ] && args+=(--tp-d "$TP_D")
[ -n "${ONLY:-}" ] && args+=(--only "$ONLY")
[ -n "${DEVICE:-}" ] && args+=(--device "$DEVICE")
[ -n "${VLLM_VERSION:-}" ] && args+=(--vllm-version "$VLLM_VERSION")
exec .venv/bin/python -m harness matrix "${args[@]}" "$@"
