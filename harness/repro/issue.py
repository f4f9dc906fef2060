"""ISSUE.md of a bundle: the text a maintainer pastes into a vLLM issue, from the run's report and logs."""

from __future__ import annotations

import json
import platform
import re
from pathlib import Path

from harness.checks.classify import SIGNATURES
from harness.checks.kv_digest import CHECK_NAME as KV_DIGEST_CHECK
from harness.checks.kv_digest import location_from_report
from harness.core.safe import shell_line
from harness.render.run_markdown import known_upstream_line


def model_config(report: dict) -> dict:
    """K, heads, head_dim (and the rest of the shape) of the served model: its config.json, else the report's heads."""
    cfg = report.get("config") or {}
    heads = cfg.get("model_heads") or {}
    out = {
        "num_attention_heads": heads.get("attention_heads"),
        "num_key_value_heads": heads.get("kv_heads"),
        "head_dim": None,
    }
    p = Path(str(cfg.get("resolved_model") or "")) / "config.json"
    try:
        c = json.loads(p.read_text()) if p.is_file() else None
    except (OSError, ValueError):  # not readable, not UTF-8 or not JSON: the report's heads only
        c = None
    if isinstance(c, dict):
        out.update(
            {
                k: c.get(k)
                for k in (
                    "num_attention_heads",
                    "num_key_value_heads",
                    "head_dim",
                    "hidden_size",
                    "num_hidden_layers",
                    "vocab_size",
                    "torch_dtype",
                )
                if c.get(k) is not None
            }
        )
        if out.get("head_dim") is None and c.get("hidden_size") and c.get("num_attention_heads"):
            out["head_dim"] = c["hidden_size"] // c["num_attention_heads"]
    return out


def matching_line(report: dict, pattern: str) -> tuple[str, str] | None:
    """(log name, first line matching ``pattern``) among the run's logs."""
    rx = re.compile(pattern, re.IGNORECASE)
    for name, path in (report.get("logs") or {}).items():
        try:
            for line in Path(path).read_text(errors="replace").splitlines():
                if rx.search(line):
                    return name, line.strip()
        except OSError:
            continue
    return None


def harness_command(report: dict, run_dir: Path) -> str:
    """The harness command that made the run: the matrix entry when the run is a matrix pair, else e2e. Each word
    quoted (a maintainer pastes it into a shell; the values come from reports)."""
    cfg = report.get("config") or {}
    version = (report.get("versions") or {}).get("vllm")
    matrix_report = run_dir.parent.parent / "report.json"
    try:
        pairs = json.loads(matrix_report.read_text()).get("pairs") or [] if matrix_report.is_file() else []
    except (OSError, ValueError, AttributeError):  # unreadable, not JSON, or not an object
        pairs = []
    for p in pairs if isinstance(pairs, list) else []:
        if isinstance(p, dict) and isinstance(p.get("run_dir"), str) and p["run_dir"]:
            try:
                same = Path(p["run_dir"]).resolve() == run_dir.resolve()
            except (OSError, ValueError):
                same = False
            if same:
                return shell_line(
                    [
                        "python",
                        "-m",
                        "harness",
                        "matrix",
                        "--only",
                        p.get("id"),
                        "--vllm-version",
                        p.get("vllm_version"),
                    ]
                )
    words = ["python", "-m", "harness", "e2e", "--tp-p", cfg.get("tp_p"), "--tp-d", cfg.get("tp_d")]
    words += ["--device", cfg.get("device")]
    if cfg.get("model"):
        words += ["--model", cfg["model"]]
    if version:
        words += ["--vllm-version", version]
    return shell_line(words)


WRONG_ANSWER = {
    "output-mismatch": "P/D answers differ from a non-disaggregated server's (greedy tokens outside the top-k)",
    "logprob-mismatch": "P/D logprobs differ from a non-disaggregated server's beyond numerical noise",
}


def issue_markdown(
    report: dict,
    run_dir: Path,
    cls: str,
    pattern: str,
    pre,
    dec,
    locked: bool,
    base=None,
    replayed: list[dict] | None = None,
) -> str:
    """ISSUE.md. ``base`` and ``replayed``: a wrong answer, replayed against that plain server (its command and the
    failing requests are shown); otherwise the log line of ``cls`` is the evidence."""
    failure = report.get("failure") or {}
    meaning = WRONG_ANSWER.get(cls) or next((s.meaning for s in SIGNATURES if s.cls == cls), cls)
    reproduced = failure.get("class") == cls or failure.get("signature") == cls
    hit = matching_line(report, pattern) if pattern else None
    lines = [
        f"# {issue_title(report, cls, meaning, hit, reproduced)}",
        "",
        *environment_section(report, locked),
        *model_section(report, dec),
        *topology_section(report),
        *commands_section(pre, dec),
    ]
    if base is not None:
        lines += reference_section(base, replayed or [])
    if any("PD_HARNESS_" in k for k in {**pre.env, **dec.env}):
        lines += [
            "The `PD_HARNESS_*` variables and `PYTHONPATH` load `cpu_tuning/sitecustomize.py` (in the bundle): "
            "on a small CPU machine it lengthens NIXL's progress-thread delay, skips the NIXL worker's core pinning "
            "and shortens idle spinning. It changes scheduling only, never what is computed.",
            "",
        ]
    lines += log_section(failure, cls, hit)
    lines += outcome_section(report, meaning, reproduced)
    lines += closing_section(report, run_dir, replays=base is not None)
    return "\n".join(lines)


def issue_title(report: dict, cls: str, meaning: str, hit: tuple[str, str] | None, reproduced: bool) -> str:
    """A reproduced failure: vLLM's issue-template title, named by the error itself where the log has it; otherwise
    what the run saw instead."""
    cfg, v, failure = report.get("config") or {}, report.get("versions") or {}, report.get("failure") or {}
    k = model_config(report).get("num_key_value_heads")
    dist = v.get("vllm_distribution") or "vllm"
    if not reproduced:
        return (
            f"NixlConnector prefill TP={cfg.get('tp_p')} -> decode TP={cfg.get('tp_d')}, "
            f"num_key_value_heads={k} on {dist} "
            f"{v.get('vllm')}: {report.get('verdict')} ({failure.get('class') or 'no failure'}); {cls} not seen"
        )
    # the error itself names the bug best: the exception text of the matching line, else the class's meaning
    said = re.search(r"(\w+(?:Error|Exception): .*)", hit[1]) if hit else None
    what = re.split(r" [\[({]", said.group(1))[0] if said else meaning  # the message without its shapes and values
    if len(what) > 110:
        what = what[:110].rsplit(" ", 1)[0] + " ..."
    blocks = (
        f", block size {cfg.get('block_size_p')} -> {cfg.get('block_size_d')}"
        if cfg.get("block_size_p") != cfg.get("block_size_d")
        else ""
    )
    return (
        f"[Bug]: NixlConnector{' heterogeneous TP' if cfg.get('tp_p') != cfg.get('tp_d') else ''}: {what} at "
        f"prefill TP={cfg.get('tp_p')} -> decode TP={cfg.get('tp_d')}{blocks}, num_key_value_heads={k} "
        f"({dist} {v.get('vllm')})"
    )


def environment_section(report: dict, locked: bool) -> list[str]:
    cfg, v = report.get("config") or {}, report.get("versions") or {}
    gpu = (
        "none (CPU run)"
        if cfg.get("device") == "cpu"
        else json.dumps((cfg.get("gpu_plan") or {}).get("gpus") or "see the run's GPU plan")
    )
    closure = (
        "(the whole closure of the run)" if locked else "(only the top-level versions: the run environment was gone)"
    )
    return [
        "## Your current environment",
        "",
        f"- vLLM: {v.get('vllm_distribution') or 'vllm'} {v.get('vllm')}",
        f"- NIXL: {v.get('nixl')}",
        f"- torch: {v.get('torch')}",
        f"- Python: {v.get('python')}",
        f"- platform: {platform.platform()} (the machine that wrote this bundle)",
        f"- GPU / driver: {gpu}",
        f"- exact package versions: `requirements.lock` of the bundle {closure}",
        "",
    ]


def model_section(report: dict, dec) -> list[str]:
    cfg, mc = report.get("config") or {}, model_config(report)
    tiny = Path(str(cfg.get("resolved_model") or "")).joinpath("harness_tiny_model.json").exists()
    family = str((cfg.get("model_heads") or {}).get("family") or "llama")
    what = (
        f"(a tiny random-weights model of the {family} family; `build_model.py` of the bundle rebuilds it offline, "
        "same weights)"
        if tiny
        else f"({cfg.get('resolved_model')})"
    )
    sizes = "".join(
        f"; {n}: {mc[n]}" for n in ("hidden_size", "num_hidden_layers", "vocab_size") if mc.get(n) is not None
    )
    dtype = "float32" if "--dtype" in dec.argv and dec.flag("--dtype") == "float32" else (dec.flag("--dtype") or "auto")
    return [
        "## Model",
        "",
        f"- served model: `{cfg.get('served_model_name')}` {what}",
        f"- K (num_key_value_heads): {mc.get('num_key_value_heads')}; attention heads: "
        f"{mc.get('num_attention_heads')}; head_dim: {mc.get('head_dim')}{sizes}",
        f"- dtype: {dtype}",
        "",
    ]


def topology_section(report: dict) -> list[str]:
    cfg = report.get("config") or {}
    topo = cfg.get("topology") or {}
    return [
        "## Topology",
        "",
        f"- prefill TP {cfg.get('tp_p')}, decode TP {cfg.get('tp_d')}; tp_ratio {topo.get('tp_ratio')}",
        f"- KV heads per rank: prefill {topo.get('p_heads_per_rank')}, decode {topo.get('d_heads_per_rank')}",
        f"- regime {topo.get('regime')}: {topo.get('regime_description')}",
        f"- KV block length per layer: prefill {topo.get('p_block_len')} B, decode {topo.get('d_block_len')} B "
        f"(block size {topo.get('block_size_p')} / {topo.get('block_size_d')})",
        "",
    ]


def commands_section(pre, dec) -> list[str]:
    return [
        "## Commands",
        "",
        "Prefill and decode, exactly as the run started them "
        "(each on 127.0.0.1; `repro.sh` uses the same with its own ports):",
        "",
        "```bash",  # as the run's .shell() wrote them, words quoted again (the report's text is not pasted as is)
        shell_line(pre.argv, pre.env),
        "",
        shell_line(dec.argv, dec.env),
        "```",
        "",
        "Then one request to the prefill server with `max_tokens: 1` and "
        '`"kv_transfer_params": {"do_remote_decode": true, ...}`, '
        "and the same request to the decode server with the `kv_transfer_params` the prefill server returned "
        "(`repro_client.py send`, the body is in `requests.json`).",
        "",
    ]


def reference_section(base, replayed: list[dict]) -> list[str]:
    """A wrong answer: the plain server it is compared with, the requests replayed, and the control without P/D."""
    return [
        "The reference is a plain server (no KV connector) started alone before P and D, with the run's baseline "
        "command:",
        "",
        "```bash",
        shell_line(base.argv, base.env),
        "```",
        "",
        "The failing request(s) replayed, as the run saw them (prompts sent as token ids to both sides):",
        "",
        *[f"- `{r['id']}`: {r['why']}" for r in replayed],
        "",
        "Control without P/D (run by `repro.sh` for each replayed prompt, printed as `no-P/D control, <id>: ...`): "
        "the plain server's own decode step after the prompt against its fresh prefill of prompt + its first "
        "token. D's first token is computed over KV it did not compute itself; if the backend's two paths "
        "already disagree without P/D, the divergence need not be P/D's.",
        "",
    ]


def log_section(failure: dict, cls: str, hit: tuple[str, str] | None) -> list[str]:
    lines = ["## Log excerpt", ""]
    if hit:
        lines += [f"First line of the run's `{hit[0]}` log matching the {cls} signature:", "", "```", hit[1], "```", ""]
    if failure.get("excerpt"):
        lines += [
            f"The run's failure (`{failure.get('class')}`, from {failure.get('source')}):",
            "",
            "```",
            str(failure["excerpt"])[:3000],
            "```",
            "",
        ]
    if not hit and not failure:
        lines += ["The run passed: no failure line.", ""]
    return lines


def outcome_section(report: dict, meaning: str, reproduced: bool) -> list[str]:
    """Expected, observed, and the upstream reports already known for this failure."""
    failure = report.get("failure") or {}
    if reproduced:
        observed = (
            f"{meaning}. The run's verdict: {report.get('verdict')} - {report.get('reason') or failure.get('reason')}"
        )
    elif report.get("verdict") == "pass":
        observed = "As expected: the handshake passed, KV moved over NIXL and the outputs matched the baseline."
    else:
        observed = f"{failure.get('class')}: {report.get('reason') or failure.get('reason')}"
    lines = [
        "## Expected",
        "",
        "The decode server accepts the NIXL handshake, reads the prompt's KV blocks from the prefill server, and its "
        "completion matches a non-disaggregated server's (greedy).",
        "",
        "## Observed",
        "",
        observed,
        "",
    ]
    lines += digest_lines(report)
    known = (
        (report.get("known_upstream") or known_upstream_line(failure, (report.get("versions") or {}).get("vllm")))
        if failure
        else None
    )
    if known:
        read = " Read the threads' current state before filing." if known.startswith("known") else ""
        lines += ["## Known upstream reports", "", f"{known}.{read}", ""]
    return lines


def digest_lines(report: dict) -> list[str]:
    """Where D's received KV first differed from P's bytes, and what it held instead (the harness's exact check)."""
    c = next((c for c in report.get("checks") or [] if c.get("name") == KV_DIGEST_CHECK), None)
    if c is None or c.get("passed"):
        return []
    where = location_from_report(c) or f"KV digest: {c.get('detail')}"
    holds = ", ".join(f"{k} {n}" for k, n in ((c.get("data") or {}).get("holds") or {}).items())
    return [
        "The harness digested each KV vector (per layer, K/V, KV head, token position) in P's cache after the prefill"
        " and in D's right after the NIXL receive, and compared them exactly:",
        "",
        f"- {where}",
        *([f"- what D held instead, by kind: {holds}"] if holds else []),
        "",
    ]


def closing_section(report: dict, run_dir: Path, replays: bool) -> list[str]:
    """The shrink's answer where there is one, what the run does not establish, and how it was found."""
    return [
        *smallest_section(run_dir),
        "## Not established",
        "",
        "The cause. Everything above is what the run measured; the harness states no cause, and a cause read "
        "from vLLM's code is a hypothesis until a control or a KV-level check shows it"
        + (" (the control without P/D that `repro.sh` prints is one such control)." if replays else "."),
        "",
        "## How it was found",
        "",
        f"`{harness_command(report, run_dir)}` (vLLM P/D heterogeneous-TP harness); run folder `{run_dir}`.",
        (
            "`repro.sh` in this folder replays it without the harness: the plain server's answers, then P and D's, "
            "compared by the run's rule; it prints REPRODUCED with the prompt and its first divergence, "
            "or NOT REPRODUCED."
            if replays
            else "`repro.sh` in this folder replays it without the harness and prints REPRODUCED with the matching "
            "log line, or NOT REPRODUCED."
        )
        + " Beside that verdict it prints the KV digest of its own P and D (`KV digest (replay): pass | FAIL | "
        "skipped ...`: D's received KV against P's, byte for byte, by the harness's check) and, where the bundle "
        "carries the run's digest records of these prompts, whether the replay differs where the run did.",
        "",
    ]


def smallest_section(run_dir: Path) -> list[str]:
    """The shrink's answer (python -m harness shrink, <run>/shrink/shrink.json) when the run folder has one."""
    try:
        sh = json.loads((Path(run_dir) / "shrink" / "shrink.json").read_text())
    except (OSError, ValueError):
        return []
    lines = [
        "## Smallest failing configuration",
        "",
        f"`python -m harness shrink` ({len(sh.get('probes') or [])} real runs"
        + (f", cut short: {sh['cut']}" if sh.get("cut") else "")
        + "): still `"
        + str(sh.get("class"))
        + "` with",
        "",
        "```",
        "python -m harness e2e " + " ".join(sh.get("carried_flags", []) + sh.get("minimal_flags", [])),
        "```",
        "",
    ]
    return lines + [f"- {a['axis']}: {a['words']}" for a in sh.get("axes") or []] + [""]
