"""Does starting P and D together pay on this machine? Real vLLM servers, started in parallel and one after another.

The pipeline starts P and D together (``start_all``); the baseline always runs alone. This measures
both orders on the same model and TP sizes, so the choice rests on a number from this machine.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness.run.config import E2EConfig
from harness.run.launch import WantedServer, make_server
from harness.serve.ports import PortAllocator
from harness.serve.procs import start_all
from harness.serve.vllm_cmd import plan_cpu_binding


def _servers(cfg: E2EConfig, alloc: PortAllocator, model: str, logs: Path, tag: str):
    binds = (
        plan_cpu_binding(os.cpu_count() or 1, [cfg.ranks("prefill"), cfg.ranks("decode")])
        if cfg.device == "cpu"
        else [None, None]
    )
    bs = cfg.block_sizes()
    wants = [
        WantedServer(
            role=role, tp=tp, model=model, served_name="tiny-llama", block_size=b, cpu_bind=bind, label=f"{role}-{tag}"
        )
        for role, tp, b, bind in (("prefill", cfg.tp_p, bs[0], binds[0]), ("decode", cfg.tp_d, bs[1], binds[1]))
    ]
    return [make_server(cfg, alloc, want, logs) for want in wants]


def _round(cfg: E2EConfig, model: str, logs: Path, tag: str, parallel: bool) -> dict:
    t0 = time.monotonic()
    with PortAllocator() as alloc, contextlib.ExitStack() as stack:
        servers = _servers(cfg, alloc, model, logs, tag)
        ready: dict[str, float] = {}
        if parallel:
            ready.update(start_all([s.proc for s in servers], stack, cfg.ready_timeout_s))
        else:
            for s in servers:
                ready.update(start_all([s.proc], stack, cfg.ready_timeout_s))
        both_ready = time.monotonic() - t0
    return {
        "order": "parallel" if parallel else "sequential",
        "both_ready_s": round(both_ready, 2),
        "launch_to_ready_s": {k: round(v, 2) for k, v in ready.items()},
    }


def run_startup_bench(repeats: int = 1, tp_p: int = 1, tp_d: int = 1, log_dir: Path | None = None) -> dict:
    from harness.models.tiny import ensure_tiny_model

    cfg = E2EConfig(tp_p=tp_p, tp_d=tp_d, python=sys.executable)
    model = str(ensure_tiny_model())
    logs = log_dir or Path(tempfile.mkdtemp(prefix="bench-startup-"))
    rounds = []
    for i in range(repeats):  # alternate, so drift in machine load hits both orders alike
        rounds.append(_round(cfg, model, logs, f"par{i}", parallel=True))
        rounds.append(_round(cfg, model, logs, f"seq{i}", parallel=False))
    med = {
        o: statistics.median(r["both_ready_s"] for r in rounds if r["order"] == o) for o in ("parallel", "sequential")
    }
    return {
        "tp_p": tp_p,
        "tp_d": tp_d,
        "cores": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "rounds": rounds,
        "median_both_ready_s": med,
        "parallel_speedup": round(med["sequential"] / med["parallel"], 2),
        "logs": str(logs),
    }


def render(d: dict) -> str:
    lines = [f"P TP{d['tp_p']} + D TP{d['tp_d']} on {d['cores']} cores (load {d['load_avg'][0]:.1f}): both ready after"]
    for r in d["rounds"]:
        lines.append(
            f"  {r['order']:<10} {r['both_ready_s']:6.1f} s  "
            f"({', '.join(f'{k} {v:.1f} s' for k, v in r['launch_to_ready_s'].items())})"
        )
    m = d["median_both_ready_s"]
    lines.append(
        f"median: parallel {m['parallel']:.1f} s, sequential {m['sequential']:.1f} s -> parallel is "
        f"{d['parallel_speedup']:.2f}x {'faster' if d['parallel_speedup'] >= 1 else 'slower'}"
    )
    return "\n".join(lines)
