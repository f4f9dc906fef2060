#!/bin/sh
# fake_python.sh MODE ARGS...: an interpreter that runs a vLLM API server as tests/fakes/fake_vllm.py in MODE
# and passes everything else (`-c CODE`, the proxy script, ...) to the real Python.
# Real Python: $FAKE_VLLM_REAL_PYTHON, else the repo's .venv/bin/python, else python3.
# $FAKE_VLLM_RECORD, when set, gets one line per invocation (so a test can prove nothing was launched).
mode=$1
shift
here=$(cd "$(dirname "$0")" && pwd)
real=${FAKE_VLLM_REAL_PYTHON:-$here/../../.venv/bin/python}
[ -x "$real" ] || real=python3
if [ -n "$FAKE_VLLM_RECORD" ]; then
    printf '%s\n' "$*" >> "$FAKE_VLLM_RECORD"
fi
if [ "$1" = "-m" ] && [ "$2" = "vllm.entrypoints.openai.api_server" ]; then
    shift 2
    exec "$real" "$here/fake_vllm.py" --mode "$mode" "$@"
fi
exec "$real" "$@"
