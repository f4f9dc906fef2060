"""`python -m harness nightly --dry-run`: every step with its command, GPU plan, server lines, checks and timeout."""

from __future__ import annotations

from collections.abc import Sequence

from harness.gpu.plan import describe_gpus, render_plan
from harness.nightly.execute import WORST_CASE_NOTE, worst_case_s
from harness.nightly.hardware import Hardware
from harness.nightly.servers import PLAN_NOTE, PORTS_NOTE
from harness.nightly.step import Step


def render_dry_run(steps: Sequence[Step], hw: Hardware) -> str:
    import shlex

    run = [s for s in steps if s.skip_reason is None]
    out = [
        f"nightly GPU run (dry run) on {describe_gpus(hw.gpus)}: {len(run)} steps to run, "
        f"{len(steps) - len(run)} skipped",
        f"GPUs: {hw.source}",
        f"worst case: {worst_case_s(steps) / 60:.0f} min ({WORST_CASE_NOTE})",
        f"note: {PORTS_NOTE}",
        f"note: {PLAN_NOTE}",
        "",
    ]
    for i, s in enumerate(steps, 1):
        state = "to run" if s.skip_reason is None else f"SKIPPED: {s.skip_reason}"
        out.append(f"[{i}/{len(steps)}] {s.id} ({s.kind}) timeout {s.timeout_s / 60:g} min [{state}]")
        if s.note:
            out.append(f"  about: {s.note}")
        if s.env:
            out.append(f"  env: {' '.join(f'{k}={v}' for k, v in s.env)}")
        out.append(f"  command: {shlex.join(s.argv)}")
        for c in s.checks:
            out.append(f"  check: {c}")
        if s.gpu_plan is not None:
            out += [f"  {line}" for line in render_plan(s.gpu_plan).splitlines()]
        for name, cmd in s.servers:
            out.append(f"  server {name}: {cmd}")
        out.append("")
    return "\n".join(out)
