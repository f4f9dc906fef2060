"""What the phases of one run share: config, folder, report, prompts, generation settings, GPU plan, leftovers."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.accuracy.lm_eval import EvalRun, run_lm_eval
from harness.accuracy.settings import AccuracySettings
from harness.gpu.run import GpuRun
from harness.hosts.faults import HOLD_EVERY, NEEDS_HOLD
from harness.run.config import E2EConfig
from harness.run.launch import Server, WantedServer, make_proxy, make_server
from harness.run.preflight import CPU_MLA_BLOCK
from harness.run.report import Report
from harness.serve.ports import PortAllocator
from harness.serve.procs import ManagedProcess
from harness.workload.client import GenerationSettings
from harness.workload.load import LoadRequest
from harness.workload.prefix import PrefixCase
from harness.workload.prompts import Prompt


@dataclass
class RunContext:
    cfg: E2EConfig
    run_dir: Path
    report: Report
    prompts: list[Prompt]
    gen: GenerationSettings
    model: str = ""  # path or hub id, once resolved
    served_name: str = ""
    accuracy: AccuracySettings | None = None  # resolved for the model; None: no lm-eval
    gpu: GpuRun | None = None  # the GPU plan applied to this run (GPU runs only)
    leftovers: list[int] = field(default_factory=list)  # PIDs still alive after a phase's teardown
    load_requests: list[LoadRequest] = field(default_factory=list)  # the load phase's plan (empty: no load phase)
    load_prompts: dict[str, list[int]] = field(default_factory=dict)  # its prompts as token ids, by request id
    prefix_cases: list[PrefixCase] = field(default_factory=list)  # the prefix-cache scenarios (D's prefix cache on)
    prefix_prompts: dict[str, list[int]] = field(default_factory=dict)  # their prompts as token ids, by case id
    # the logs when the P/D phase failed, kept where a follow-up (P's blocks after a network fault) made the servers
    # log more before teardown: the failure is classified from what led to it, not from what followed
    failure_logs: dict[str, str] | None = None

    @property
    def logs(self) -> Path:
        return self.run_dir / "logs"

    @property
    def model_heads(self) -> dict:
        """What harness/models/heads.py read from the served model ({} until then)."""
        return self.report.config.get("model_heads") or {}

    @property
    def kv_cache_groups(self) -> int:
        """The served model's KV cache groups (1 until its heads are read)."""
        return int(self.model_heads.get("kv_cache_groups") or 1)

    def pool_block_size(self, block_size: int | None) -> int | None:
        """The block size the KV pool is counted in: vLLM's reference CPU MLA path serves 16-token blocks whatever is
        asked, so a pool counted in the asked 32 would not hold one longest request."""
        if self.model_heads.get("mla") and self.cfg.device == "cpu" and block_size:
            return min(block_size, CPU_MLA_BLOCK)
        return block_size

    def pool_blocks(self, block_size: int | None) -> int | None:
        """The KV blocks each server of this run gets (E2EConfig.pool_blocks, in the blocks vLLM will serve)."""
        return self.cfg.pool_blocks(self.pool_block_size(block_size), self.kv_cache_groups)

    def server_pool(self, role: str, block_size: int | None) -> int | None:
        """A server's KV blocks: D's own where the run sizes it to preempt (kv_pool_blocks_d), else the run's."""
        d_pool = self.cfg.axes.kv_pool_blocks_d
        return d_pool if role == "decode" and d_pool is not None else self.pool_blocks(block_size)

    def timed(self, key: str, t0: float) -> None:
        self.report.timings_s[key] = time.monotonic() - t0

    def server(
        self,
        alloc: PortAllocator,
        role: str,
        tp: int,
        block_size: int | None,
        cpu_bind: str | None,
        kv_layout: str | None = None,
    ) -> Server:
        """A server of this run (not started), recorded in the report's commands and logs."""
        placement = self.gpu.placement(role) if self.gpu is not None else None
        aborts = self.cfg.load.enabled and self.cfg.load.abort_every > 0 and role != "baseline"
        want = WantedServer(
            role=role,
            tp=tp,
            model=self.model,
            served_name=self.served_name,
            block_size=block_size,
            cpu_bind=cpu_bind,
            kv_layout=kv_layout,
            placement=placement,
            num_blocks=self.server_pool(role, block_size),
            log_requests=aborts,
        )
        srv = make_server(self.cfg, alloc, want, self.logs)
        self.report.commands[role] = srv.command
        self.report.logs[role] = str(srv.proc.spec.log_path)
        for name, proc, command in srv.followers:
            self.report.commands[name] = command
            self.report.logs[name] = str(proc.spec.log_path)
        return srv

    def proxy(
        self, alloc: PortAllocator, prefill_urls: list[str], decode_urls: list[str]
    ) -> tuple[ManagedProcess, str]:
        hold = self.cfg.net_fault in NEEDS_HOLD
        proc, url = make_proxy(
            self.cfg.python,
            alloc,
            prefill_urls,
            decode_urls,
            self.logs,
            self.cfg.request_timeout_s,
            fault=self.cfg.proxy_fault if not hold else "hold-between-hops",
            fault_every=self.cfg.proxy_fault_every if not hold else HOLD_EVERY,
            host=self.cfg.hosts.proxy,
            hold_dir=self.hold_dir if hold else None,
        )
        self.report.commands["proxy"] = " ".join(proc.spec.argv)
        self.report.logs["proxy"] = str(proc.spec.log_path)
        return proc, url

    @property
    def hold_dir(self) -> Path:
        """Where the proxy marks a request it holds for a network fault, and the harness lets it go on."""
        return self.run_dir / "faults"

    def lm_eval(self, url: str, which: str, watch: list) -> EvalRun:
        """lm-eval against ``url`` (``which``: pd or baseline) while watching the servers it talks to."""
        assert self.accuracy is not None
        t0 = time.monotonic()
        log = self.logs / f"lm_eval_{which}.log"
        self.report.logs[f"lm_eval_{which}"] = str(log)
        out = run_lm_eval(
            self.cfg.python, url, self.served_name, self.accuracy, self.run_dir / "lm_eval" / which, log, watch
        )
        self.timed(f"lm_eval_{which}", t0)
        return out

    def read_logs(self) -> dict[str, str]:
        """Every log this run recorded, by name (a log not written yet is left out)."""
        out = {}
        for role, path in self.report.logs.items():
            with contextlib.suppress(OSError):
                out[role] = Path(path).read_text(errors="replace")
        return out

    def logs_for_failure(self) -> dict[str, str]:
        """The logs a run's failure is classified from: ``failure_logs`` where kept, else every log as it is now."""
        return self.failure_logs if self.failure_logs is not None else self.read_logs()
