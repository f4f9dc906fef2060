"""python -m harness shrink RUN_DIR: the smallest configuration that still fails as the run did, each probe a real run.

The run folder may be a matrix pair's (runs/<matrix>/vllm-<version>/<entry>). Probes are `python -m harness e2e`
runs in <out>/probe-NN with the run's model, device, interpreter and every setting the search does not move; they
share the baseline cache (a probe whose baseline was computed before reads it from disk).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from harness.core.errors import ConfigError
from harness.core.files import new_folder
from harness.core.paths import REPO_ROOT
from harness.core.safe import comment, load_json_object
from harness.repro.replayed import failing, rule_of
from harness.shrink.search import Probe, Settings, ShrinkResult, shrink
from harness.workload.prompts import prompt_set


def add_parser(sub) -> None:
    s = sub.add_parser(
        "shrink",
        help="search for the smallest configuration that still fails with a run's class (each probe a real run)",
    )
    s.add_argument("run_dir", type=Path, help="a failing run folder (holding report.json), e.g. a matrix pair's folder")
    s.add_argument("--out", type=Path, help="where probes and shrink.json/.md go (default: <run_dir>/shrink)")
    s.add_argument("--max-probes", type=int, default=8, help="at most this many probe runs (default 8)")
    s.add_argument("--max-minutes", type=float, default=60.0, help="stop starting probes after this long (default 60)")


def start_of(report: dict) -> tuple[str, Settings, list[str], tuple[str, ...]]:
    """(the failure class, the settings the search moves, the e2e flags it carries unchanged, the failing sequential
    prompts shortest first); ConfigError when the run cannot be shrunk."""
    cfg = report.get("config") or {}
    failure = report.get("failure") or {}
    if report.get("verdict") == "pass" or not failure.get("class"):
        raise ConfigError("the run passed: nothing to shrink")
    if cfg.get("attach"):
        raise ConfigError("an attach-mode run: its servers were started elsewhere, so no probe can change them")
    if (cfg.get("proxy_fault") or "none") != "none" or cfg.get("decode_kv_fault"):
        raise ConfigError(
            "the run failed under an injected fault (--proxy-fault / --decode-kv-fault): "
            "there is no vLLM configuration to shrink"
        )
    if report.get("simulated"):
        raise ConfigError("a run on simulated GPUs: stand-ins served it")
    axes, load = cfg.get("axes") or {}, cfg.get("load") or {}
    start = Settings(
        int(cfg.get("tp_p") or 1),
        int(cfg.get("tp_d") or 1),
        cfg.get("block_size_p"),
        cfg.get("block_size_d"),
        bool(axes.get("prefix_caching_d")),
        int(load.get("requests") or 0),
        axes.get("kv_cache_dtype"),
        tuple(cfg["prompt_ids"]) if cfg.get("prompt_ids") else None,
    )
    resolved = cfg.get("resolved_model")
    model = resolved if resolved and Path(resolved).is_dir() else cfg.get("model")
    carried = ["--device", str(cfg.get("device") or "cpu")]
    for flag, value in (
        ("--model", model),
        ("--python", cfg.get("python")),
        ("--max-tokens", cfg.get("max_tokens")),
        ("--dtype", cfg.get("dtype")),
        ("--kv-layout-d", cfg.get("kv_layout_d")),
        ("--logprob-threshold", cfg.get("logprob_threshold")),
        ("--max-model-len", cfg.get("max_model_len")),
        ("--attention-backend", axes.get("attention_backend")),
        ("--kv-buffer-device", axes.get("kv_buffer_device")),
        ("--speculative-config", axes.get("speculative_config")),
        ("--speculative-tokens-p", axes.get("speculative_tokens_p")),
        ("--max-num-batched-tokens-p", axes.get("max_num_batched_tokens_p")),
        ("--compilation-config", axes.get("compilation_config")),
        ("--data-parallel-size-d", axes.get("data_parallel_size_d")),
        ("--kv-pool-blocks-d", axes.get("kv_pool_blocks_d")),
        ("--pipeline-parallel-size-p", axes.get("pipeline_parallel_size_p")),
        ("--decode-context-parallel-size-d", axes.get("decode_context_parallel_size_d")),
        ("--kv-offload-bytes", axes.get("kv_offload_bytes")),
    ):
        if value is not None:
            carried += [flag, str(value)]
    if axes.get("async_scheduling") is not None:
        carried.append("--async-scheduling" if axes["async_scheduling"] else "--no-async-scheduling")
    if axes.get("permute_local_kv_d"):
        carried.append("--permute-local-kv-d")
    if axes.get("expert_parallel_d"):
        carried.append("--expert-parallel-d")
    sequential = {p.id: p.words for p in prompt_set(int(cfg.get("seed") or 0))}
    bad = sorted((pid for pid, _ in failing(report, rule_of(report)) if pid in sequential), key=lambda p: sequential[p])
    return str(failure["class"]), start, carried, tuple(bad)


def real_probe(carried: list[str], out: Path, timeout_s: float):
    """A probe that runs `python -m harness e2e` for real; its outcome is the run's failure class, or ok."""
    count = [0]

    def run(s: Settings) -> Probe:
        count[0] += 1
        run_dir = new_folder(out / f"probe-{count[0]:02d}")  # a second shrink of one run never reuses a probe's folder
        argv = [sys.executable, "-m", "harness", "e2e", *carried, *s.flags(), "--run-dir", str(run_dir)]
        print(f"shrink: probe {count[0]}: {s.describe()}", flush=True)
        t0 = time.monotonic()
        try:
            subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return Probe(s, "probe-timeout", time.monotonic() - t0, str(run_dir))
        try:
            rep = json.loads((run_dir / "report.json").read_text())
        except (OSError, ValueError):
            return Probe(s, "harness-error", time.monotonic() - t0, str(run_dir))
        failed = str((rep.get("failure") or {}).get("class") or "checks-failed")
        outcome = "ok" if rep.get("verdict") == "pass" else failed
        print(f"shrink: probe {count[0]}: {outcome} ({time.monotonic() - t0:.0f} s)", flush=True)
        return Probe(s, outcome, time.monotonic() - t0, str(run_dir))

    return run


def render(result: ShrinkResult, carried: list[str], run_dir: Path) -> str:
    cmd = shlex.join(["python", "-m", "harness", "e2e", *carried, *result.minimal.flags()])
    lines = [
        f"# Shrink of {run_dir}",
        "",
        f"- failure class: `{result.cls}`",
        f"- started from: {result.start.describe()}",
        f"- smallest still failing: {result.minimal.describe()}",
        f"- its command: `{cmd}`",
        "",
    ]
    if result.cut:
        lines += [f"**Cut short**: {result.cut}; the axes marked undecided were not decided.", ""]
    lines += ["## Per axis", ""] + [f"- **{a.axis}** ({a.verdict}): {a.words}" for a in result.axes]
    lines += ["", "## Probes", "", "| # | configuration | outcome | s | run |", "|---|---|---|---|---|"]
    lines += [
        f"| {i} | {p.settings.describe()} | {p.outcome} | {p.seconds:.0f} | {p.run_dir} |"
        for i, p in enumerate(result.probes, 1)
    ]
    lines += [
        "",
        "Not shrunk here: the load and prefix-cache prompts (a repro bundle of the smallest run replays only "
        "its failing requests: `python -m harness repro <probe folder>`), a prompt's length within itself, "
        "and the "
        "model's shape.",
    ]
    return "\n".join(lines) + "\n"


def search_and_write(run_dir: Path, out: Path, begun: tuple, max_probes: int, max_minutes: float):
    """The search with real probes in ``out`` from ``begun`` (``start_of``'s answer for the run in ``run_dir``), its
    shrink.json and shrink.md written there; the result."""
    cls, start, carried, bad = begun
    probe = real_probe(carried, out, max_minutes * 60)
    result = shrink(start, cls, probe, max_probes, max_minutes * 60, failing_prompts=bad)
    (out / "shrink.json").write_text(json.dumps({**result.to_dict(), "carried_flags": carried}, indent=2) + "\n")
    (out / "shrink.md").write_text(render(result, carried, run_dir))
    return result


def main(a: argparse.Namespace) -> int:
    try:
        if a.max_probes < 1 or a.max_minutes <= 0:
            raise ConfigError("--max-probes must be >= 1 and --max-minutes > 0")
        p = Path(a.run_dir) / "report.json"
        if not p.exists():
            raise ConfigError(f"{a.run_dir} holds no report.json (give a run folder, e.g. a matrix pair's folder)")
        try:
            cls, start, carried, bad = start_of(load_json_object(p, "report"))
        except ConfigError:
            raise
        except (TypeError, ValueError, KeyError, AttributeError) as e:  # a field of another shape than a run writes
            raise ConfigError(
                f"{p}: a field is not what a run writes ({type(e).__name__}: {comment(e, 200)})"
            ) from None
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(a.out) if a.out else Path(a.run_dir) / "shrink"
    out.mkdir(parents=True, exist_ok=True)
    print(f"shrink: {cls} from {start.describe()}; at most {a.max_probes} probes, {a.max_minutes:g} min", flush=True)
    result = search_and_write(Path(a.run_dir), out, (cls, start, carried, bad), a.max_probes, a.max_minutes)
    print(result.summary())
    print(f"shrink: {out / 'shrink.md'}")
    return 0
