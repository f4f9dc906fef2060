"""One P/D run end to end: resolve and check what runs, then the phases (baseline, P/D, evaluation) and the report.

Each phase is a module of its own (``baseline.py``, ``pd.py``, ``evaluate.py``); failures are mapped to
classes in ``failures.py``. ``PDRun`` only orders them and makes sure a report is written on every exit path.
"""

from __future__ import annotations

import os
import time

from harness.accuracy.resolve import resolve_accuracy
from harness.core import progress
from harness.core.errors import ConfigError
from harness.gpu.run import GpuRun
from harness.hosts.reach import check_reachable
from harness.models.heads import model_heads
from harness.run import failures
from harness.run.attach_report import attach_report
from harness.run.baseline import BaselineResult, run_baseline
from harness.run.config import E2EConfig
from harness.run.context import RunContext
from harness.run.evaluate import evaluate
from harness.run.launch import new_run_dir, resolve_model
from harness.run.pd import local_servers, run_pd
from harness.run.preflight import attached_baseline_gpu, preflight, require_model
from harness.run.prompt_fit import model_prompts, selected_prompts
from harness.run.prompts_file import write_prompts
from harness.run.report import Report, write_report
from harness.run.thresholds import ThresholdStore, apply_threshold
from harness.run.timing import breakdown
from harness.run.versions import installed_versions
from harness.serve.ports import PortAllocator
from harness.serve.servers import Attach, AttachedServers, card_max_model_len, model_card
from harness.serve.vllm_cmd import plan_cpu_binding
from harness.workload.client import GenerationSettings
from harness.workload.token_text import divergence_spans, load_decoder


class PDRun:
    """One run. ``baseline_last`` runs the baseline after P/D (and not at all when P/D fails);
    ``baseline_cache`` shares baseline answers between runs of one matrix; ``attach`` uses servers started elsewhere;
    ``thresholds``: the calibrated logprob thresholds (default: the store beside the results store)."""

    def __init__(
        self,
        cfg: E2EConfig,
        baseline_last: bool = False,
        baseline_cache: dict[tuple, BaselineResult] | None = None,
        attach: Attach | None = None,
        thresholds: ThresholdStore | None = None,
    ):
        if attach is not None and not cfg.baseline:  # attached servers carry no digest hook of ours
            raise ConfigError("--no-baseline needs the KV digest, which attach mode cannot make: give a baseline")
        self.cfg = cfg
        self.attach = attach
        # a network fault is meant to end the run in the P/D phase: a baseline first would be started for nothing
        self.baseline_last = baseline_last or cfg.net_fault != "none"
        self.baseline_cache = baseline_cache
        self.thresholds = thresholds or ThresholdStore()
        self.run_dir = new_run_dir(cfg)
        self.ctx = RunContext(
            cfg,
            self.run_dir,
            Report(config=cfg.to_dict()),
            selected_prompts(cfg),
            GenerationSettings(
                max_tokens=cfg.max_tokens, logprobs=cfg.logprobs, seed=cfg.seed, timeout_s=cfg.request_timeout_s
            ),
        )

    @property
    def report(self) -> Report:
        return self.ctx.report

    def run(self) -> dict:
        """Run, and write report.json/report.md whatever happens (an interrupt is re-raised after the report)."""
        wall = time.monotonic()
        rep = progress.current()
        mark = rep.mark()  # the spans of this run's steps become the report's timeline
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:  # the versions too: a signal while they are read still ends with a report (class interrupted)
            self.report.versions = installed_versions(self.cfg.python)
            self._run()
        except KeyboardInterrupt as e:  # servers are down by now
            self.report.failure = failures.interrupted(e)
            raise
        except Exception as e:
            self.report.failure = failures.from_exception(e, self.ctx.logs_for_failure)
        finally:
            self.ctx.timed("wall", wall)
            staggered = bool((self.report.config.get("gpu_plan") or {}).get("stagger_start"))
            self.report.timing_breakdown = breakdown(self.report.timings_s, staggered).to_dict()
            self.report.events = rep.events_since(mark, wall)
            rep.clear()
            write_prompts(self.ctx, self.run_dir)
            d = write_report(self.report, self.run_dir, self.cfg.runs_root if self.cfg.run_dir is None else None)
        return d

    def _run(self) -> None:
        ctx, cfg = self.ctx, self.cfg
        self._resolve()
        bs_p, bs_d = cfg.block_sizes()
        binds: list[str | None] = [None, None]
        if cfg.device == "cpu":
            binds = list(plan_cpu_binding(os.cpu_count() or 1, [cfg.ranks("prefill"), cfg.ranks("decode")]))
        ctx.report.config["cpu_bind"] = {"prefill": binds[0], "decode": binds[1], "baseline": binds[1]}
        attached_baseline = self.attach.baseline_url if self.attach else None

        with PortAllocator() as alloc:
            if len({h.name for h in cfg.hosts.placed()}) > 1:  # across hosts: each must answer before a launch
                probed = check_reachable(cfg.hosts.placed(), alloc.port())
                ctx.report.config["hosts_reached"] = probed
            # The baseline runs alone (never beside P/D), at D's TP and D's cores, so both sides compute alike.
            baseline = (
                None
                if self.baseline_last or not cfg.baseline
                else phase("baseline", run_baseline, ctx, alloc, bs_d, binds[1], attached_baseline, self.baseline_cache)
            )
            servers = (
                AttachedServers(
                    self.attach.prefill_urls,
                    self.attach.decode_urls,
                    health_grace_s=cfg.health_grace_s,
                    digest_dir=self.attach.digest_dir,
                )
                if self.attach
                else local_servers(ctx, alloc, (bs_p, bs_d), binds)
            )
            pd = phase("P/D", run_pd, ctx, alloc, servers)
            if baseline is None and cfg.baseline:
                baseline = phase(
                    "baseline", run_baseline, ctx, alloc, bs_d, binds[1], attached_baseline, self.baseline_cache
                )

        phase("evaluation", evaluate, ctx, baseline, pd)
        add_token_spans(ctx, baseline, pd)
        runs = [pd.completions] + ([baseline.completions] if baseline is not None else [])
        self.report.failure = failures.from_checks(self.report.checks, ctx.read_logs(), runs)

    def _resolve_attached(self) -> None:
        """The model the attached decode server serves, within its max_model_len; a baseline launched here (no
        --baseline-url) needs the model on this machine and, on GPU, a placement of its own."""
        ctx, cfg, attach = self.ctx, self.cfg, self.attach
        assert attach is not None
        card = model_card(attach.decode_urls[0])
        ctx.served_name, root = str(card["id"]), str(card.get("root") or card["id"])
        ctx.model = cfg.model or root
        served_len = card_max_model_len(card)
        if served_len is not None and cfg.model_len > served_len:
            raise ConfigError(
                f"{attach.decode_urls[0]} serves at most {served_len} tokens, this run's prompts may "
                f"take {cfg.model_len} (--max-model-len)"
            )
        if attach.baseline_url is None:
            require_model(ctx.model, "the baseline runs here (no --baseline-url), but ")
            if cfg.device == "gpu":
                ctx.gpu = attached_baseline_gpu(cfg, ctx.model)
                ctx.report.config["gpu_plan"] = ctx.gpu.plan.to_dict()

    def _resolve(self) -> None:
        """The model, its heads and topology, the GPU plan and the accuracy settings; refuse what cannot run."""
        ctx, cfg = self.ctx, self.cfg
        progress.current().phase(
            f"run P {cfg.tp_label('tp_p')} -> D {cfg.tp_label('tp_d')} on {cfg.device}: "
            f"resolving the model {cfg.model or '(default)'}"
        )
        if self.attach is not None:
            self._resolve_attached()
        else:
            ctx.model, ctx.served_name = resolve_model(cfg)
            require_model(ctx.model)  # servers run offline: a model not on this machine is refused before any launch
        config = ctx.report.config
        config["resolved_model"] = ctx.model
        config["served_model_name"] = ctx.served_name
        heads = config["model_heads"] = model_heads(ctx.model)
        # in the served model's own tokens where the harness did not make it (attach: what D serves)
        built = model_prompts(cfg, ctx.model)
        ctx.prompts = built.prompts
        config["prompts"] = len(ctx.prompts)
        config["sequential_prompts"] = built.record()
        if (
            self.attach is None
        ):  # refuse what cannot run before anything starts (the CLI checked the same, if it was used)
            pf = preflight(
                heads["attention_heads"],
                heads["kv_heads"],
                cfg.tp_p,
                cfg.tp_d,
                *cfg.block_sizes(),
                cfg.device,
                mla=bool(heads.get("mla")),
                head_dim=heads.get("head_dim"),
                pp_p=cfg.axes.pp_p,
                dcp_d=cfg.axes.dcp_d,
            )
            config["topology"] = pf.topology.to_dict() if pf.topology else None
            if pf.problems:
                raise ConfigError(pf.message())
            if cfg.device == "gpu":
                ctx.gpu = GpuRun(cfg.tp_p, cfg.tp_d, ctx.model, gpu_memory_utilization=cfg.gpu_memory_utilization)
                config["gpu_plan"] = ctx.gpu.plan.to_dict()
        config["attach"] = attach_report(cfg, self.attach) if self.attach else None
        ctx.accuracy = resolve_accuracy(cfg.accuracy, ctx.model, ctx.served_name) if cfg.accuracy is not None else None
        if ctx.accuracy is not None:
            config["accuracy"] = ctx.accuracy.to_dict()
        self.cfg = ctx.cfg = apply_threshold(ctx, self.attach is not None, self.thresholds)


def phase(name: str, fn, *args):
    """One phase of the run, as a step on the timeline and a line for whoever watches."""
    with progress.current().step(name, "phase", announce=f"{name} phase"):
        return fn(*args)


def add_token_spans(ctx: RunContext, baseline: BaselineResult | None, pd) -> None:
    """Where the first divergent token of each diverged prompt lies in both texts (report.html highlights it),
    from the model's own tokenizer; left out, with why, when its decoding does not reproduce the texts."""
    comp = ctx.report.comparison
    if baseline is None or not comp or not any(p.get("divergence") for p in comp.get("prompts", [])):
        return
    decode, why = load_decoder(ctx.model)
    if decode is None:
        comp["token_spans_note"] = why
        return
    ids: dict[str, dict] = {}
    for side, run in (("baseline", baseline.completions), ("pd", pd.completions)):
        for c in run.completions:
            ids.setdefault(c.prompt_id, {})[side] = c.token_ids
    try:
        comp["token_spans"] = divergence_spans(comp["prompts"], ids, comp.get("texts", {}), decode)
    except Exception as e:  # a decoration of the report: never what decides a verdict, but said when it fails
        comp["token_spans_note"] = f"token spans could not be computed: {type(e).__name__}: {e}"
