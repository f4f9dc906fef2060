"""The KV digest in a repro bundle (docs/kv-digest.md): the harness's hooks (serve/inject/) and its comparer
(checks/kv_digest.py) copied in as text, the environment that makes the replay's P and D digest their own KV, and
repro.sh's step that compares the replay's records, and the run's ones the bundle carries (``kv_digest/``).
"""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

from harness.serve.vllm_cmd import INJECT_DIR

HOOKS = "hooks"  # the bundle's folder of the servers' hooks, first on P's and D's PYTHONPATH
HOOK_FILES = ("sitecustomize.py", "pd_kv_digest.py", "pd_kv_state.py")
FAULT_MODULE = "pd_kv_fault.py"
FAULT_ENV_PREFIX = "PD_HARNESS_FAULT_"
# sitecustomize.py imports the fault module whatever the run did: a run without a fault gets this, not the fault code
FAULT_STANDIN = (
    '"""Stands in for the harness\'s decode-KV fault module (pd_kv_fault.py): the run injected no fault. '
    'sitecustomize.py imports it."""\n\nARMED = False\n'
)
CHECKS_DIR = Path(__file__).resolve().parents[1] / "checks"
# The comparer: the harness's own check (numpy and the standard library), its one project import pointed at the copy
# of check.py beside it. {file in rule/: (source, (import, replacement) or None)}.
COMPARER_FILES: dict[str, tuple[Path, tuple[str, str] | None]] = {
    "kv_digest.py": (
        CHECKS_DIR / "kv_digest.py",
        ("from harness.checks.check import Check", "from check import Check"),
    ),
    "check.py": (CHECKS_DIR / "check.py", None),
}
REPLAY_RECORDS = "$WORK/replay/kv_digest"  # where the replay's P and D write their records (prefill/, decode/)


def faulted(envs: list[dict[str, str]]) -> bool:
    """Whether the run injected a decode-KV fault (its P or D command sets a PD_HARNESS_FAULT_* variable)."""
    return any(k.startswith(FAULT_ENV_PREFIX) for env in envs for k in env)


def write_hooks(out: Path, with_fault: bool) -> None:
    """The hooks folder: the digest's sitecustomize.py and module, and the fault module (or its inert stand-in)."""
    hooks = out / HOOKS
    hooks.mkdir(exist_ok=True)
    for name in HOOK_FILES:
        shutil.copy(INJECT_DIR / name, hooks / name)
    if with_fault:  # replayed as the run had it: the fault's variables are in the run's command
        shutil.copy(INJECT_DIR / FAULT_MODULE, hooks / FAULT_MODULE)
    else:
        (hooks / FAULT_MODULE).write_text(FAULT_STANDIN)


def env_words(role: str) -> list[str]:
    """repro.sh's words that make P or D (``role``) digest its KV; with REPRO_KV_DIGEST=0 the folder is empty and the
    hooks stay inert."""
    return [f'"PD_HARNESS_KV_DIGEST=${{REPLAY_DIGEST:+$REPLAY_DIGEST/{role}}}"', f"PD_HARNESS_KV_DIGEST_SIDE={role}"]


def setup_lines() -> list[str]:
    return [
        "# The replay digests its own KV (hooks/: the harness's, copied) into $WORK/replay/kv_digest;",
        "# REPRO_KV_DIGEST=0 leaves the hooks inert.",
        f'REPLAY_DIGEST="{REPLAY_RECORDS}"',
        'if [ "${REPRO_KV_DIGEST:-1}" = 0 ]; then REPLAY_DIGEST=""; fi',
    ]


def clear_lines() -> list[str]:
    return [f"rm -rf \"{REPLAY_RECORDS}\"  # an earlier replay's records are not this one's"]


def step_lines(vllm: str) -> list[str]:
    """After the verdict: P and D stopped (every record written), the digest compared; the exit code stays the
    verdict's."""
    return [
        "# The KV digest, beside the verdict: D's received KV against P's, byte for byte (rule/kv_digest.py, the",
        "# harness's check); with the run's records of these prompts (kv_digest/), whether the replay differs where",
        "# the run did. It never changes the exit code.",
        'stop_group "$P_PID"; stop_group "$D_PID"',
        'if [ -n "$REPLAY_DIGEST" ]; then',
        '  "$VENV_PY" "$HERE/repro_client.py" digest "$REPLAY_DIGEST" --run "$HERE/kv_digest" '
        f'--answers "$WORK/answers.json" --vllm {shlex.quote(vllm)} '
        '|| echo "KV digest (replay): the comparer failed (its error is above)"',
        "else",
        '  echo "KV digest (replay): skipped: turned off (REPRO_KV_DIGEST=0)"',
        "fi",
    ]
