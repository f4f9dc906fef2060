"""What a run's baseline is keyed by in the disk cache (harness/cache/baseline.py): everything in the run's context
that can change the baseline's answers, and where an entry came from."""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from harness.accuracy.lm_eval import lm_eval_argv
from harness.cache import baseline as disk
from harness.checks.compare import COMPARISON_VERSION
from harness.core.redact import redact_text
from harness.run.context import RunContext
from harness.workload.load import plan_load
from harness.workload.load_client import load_body
from harness.workload.prefix import plan_prefix


def key_inputs(
    ctx: RunContext, server: Mapping[str, Any], block_size: int | None, environ: Mapping[str, str] = os.environ
) -> dict[str, Any]:
    """Everything that can change the baseline's answers (``server``: its ``command_identity``)."""
    cfg = ctx.cfg
    load = None
    if cfg.load.enabled:
        plan = plan_load(cfg.load, block_size or 16, cfg.model_len, cfg.max_tokens, cfg.seed)
        load = {
            "settings": cfg.load.to_dict(),
            "plan": [r.to_dict() for r in plan],
            "body": load_body(ctx.gen, ctx.served_name, plan[0], [0]) if plan else None,
        }
    accuracy = None
    if ctx.accuracy is not None:
        s = ctx.accuracy
        accuracy = {
            "settings": s.to_dict(),
            "argv": lm_eval_argv(cfg.python, "<url>", ctx.served_name, s, Path("<out>"))[1:] if s.task else None,
            "task_files_sha256": disk.files_hash(Path(s.include_path), disk.cache_root() / disk.FILE_HASHES)
            if s.include_path
            else None,
        }
    gen = {
        k: v for k, v in asdict(ctx.gen).items() if k != "timeout_s"
    }  # a deadline: a late answer is a failure, never cached
    return {
        "entry_format": disk.ENTRY_FORMAT,
        "comparison_version": COMPARISON_VERSION,
        "device": cfg.device,
        "tp": cfg.tp_d,
        "dtype": cfg.dtype,
        "block_size": block_size,
        "kv_pool_blocks": ctx.pool_blocks(block_size),
        "max_model_len": cfg.model_len,
        "server": dict(server),
        "inherited_env": disk.inherited_env(environ, server.get("env", {})),
        "model": disk.model_identity(ctx.model, disk.cache_root() / disk.FILE_HASHES),
        "served_model_name": ctx.served_name,
        "python": disk.python_identity(cfg.python),
        "cpu": disk.cpu_identity(),
        # what is sent: the text (the harness's own models: keys as ever), or the model's token ids
        "prompts": [[p.id, p.payload] for p in ctx.prompts],
        "generation": {**gen, "body": ctx.gen.body(ctx.served_name, "<prompt>")},
        "load": load,
        # D's prefix-cache scenarios (their prompts follow from the plan, the tokenizer and the seed, all keyed)
        "prefix_scenarios": [c.to_dict() for c in plan_prefix(block_size or 16)] if cfg.axes.prefix_caching_d else None,
        "accuracy": accuracy,
    }


def new_meta(ctx: RunContext, command: str) -> dict[str, Any]:
    """Where an entry came from: the run folder that computed it, when, with which command and versions."""
    t = ctx.report.timings_s
    return {
        "from_run": str(ctx.run_dir),
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": redact_text(command),
        "versions": dict(ctx.report.versions),
        "timings_s": {k: round(v, 3) for k, v in t.items() if k.startswith(("baseline_", "lm_eval_baseline"))},
    }
