"""Attach mode takes device, dtype and max_model_len from the attached servers, not from the harness's host; it
refuses (exit 2, one line, no run folder) when it cannot tell the device; a baseline launched here gets that device,
dtype and, on GPU, a placement (issue 23, item 6). The servers are stand-ins over HTTP; NVML is a fake."""

from __future__ import annotations

import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from harness.cli import main
from harness.core.errors import ConfigError
from harness.run.config import LOGPROB_THRESHOLD, E2EConfig, attach_settings
from harness.run.pipeline import PDRun as RealPDRun
from harness.serve.axes import ServerAxes
from harness.serve.servers import Attach, Served, read_attached, read_served, server_info_facts
from tests.unit.gpu.fake_nvml import FakeNvml, gpus

TINYLLAMA = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"  # in this folder's stand-in hub cache (conftest.py)
CACHE_INFO = (
    'vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",gpu_memory_utilization="0.9",'
    'num_gpu_blocks="9000"} 1.0\n'
)


class StandIn:
    """A vLLM server as seen over HTTP: /health, /v1/models, /metrics; /server_info only in ``dev_mode``
    (VLLM_SERVER_DEV_MODE=1), with ``device`` as vLLM names it (cuda, cpu) and the model ``dtype``."""

    def __init__(
        self,
        root: str = TINYLLAMA,
        max_model_len: int = 4096,
        dev_mode: bool = False,
        device: str = "cuda",
        dtype: str = "torch.bfloat16",
        cache: str = CACHE_INFO,
        tp: int = 1,
    ):
        info = {
            "vllm_config": {
                "model_config": {"dtype": dtype, "max_model_len": max_model_len},
                "device_config": {"device": device},
                "parallel_config": {"tensor_parallel_size": tp},
            }
        }
        routes = {
            "/health": b"",
            "/metrics": cache.encode(),
            "/v1/models": json.dumps(
                {"data": [{"id": "served", "root": root, "max_model_len": max_model_len}]}
            ).encode(),
        }
        if dev_mode:
            routes["/server_info"] = json.dumps(info).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                body = routes.get(self.path.split("?")[0])
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Length", str(len(body or b"")))
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture
def stand_in():
    made: list[StandIn] = []

    def make(**kw) -> str:
        made.append(StandIn(**kw))
        return made[-1].url

    yield make
    for s in made:
        s.httpd.shutdown()
        s.httpd.server_close()


@pytest.fixture
def remote(monkeypatch):
    """The attached servers count as on another node (a GPU-less head node attached to GPU servers)."""
    monkeypatch.setattr("harness.run.config.on_this_host", lambda url: False)


@pytest.fixture
def captured(monkeypatch):
    """PDRun replaced: what the CLI would run with (config, attach)."""
    got: dict = {}

    class Stop(Exception):
        pass

    def no_run(cfg, attach=None):
        got.update(cfg=cfg, attach=attach)
        raise Stop

    monkeypatch.setattr("harness.run.pipeline.PDRun", no_run)
    monkeypatch.setattr("harness.gpu.detect.has_nvidia_gpu", lambda *a, **k: False)  # the harness's own host has no GPU
    return got, Stop


def attach_argv(p: str, d: str, *extra: str) -> list[str]:
    return ["e2e", "--prefill-url", p, "--decode-url", d, *extra]


def test_what_a_server_says_about_itself(stand_in):
    dev = read_served(stand_in(dev_mode=True))
    assert (dev.model, dev.name, dev.max_model_len) == (TINYLLAMA, "served", 4096)
    assert (dev.device, dev.dtype) == ("gpu", "bfloat16")
    assert dev.cache["block_size"] == "16" and "engine" not in dev.cache and dev.unread == ()
    plain = read_served(stand_in())
    assert (plain.device, plain.dtype, plain.max_model_len) == (None, None, 4096)
    assert len(plain.unread) == 1 and "/server_info" in plain.unread[0]
    # an older vLLM answers /server_info in text only
    assert server_info_facts(
        {"vllm_config": "model='m', dtype=torch.float16, max_seq_len=8, kv_cache_dtype=auto, device_config=cpu, seed=0"}
    ) == ("cpu", "float16")


def test_a_gpu_less_head_node_attached_to_bf16_gpu_servers_compares_as_gpu(stand_in, remote, captured, tmp_path):
    got, Stop = captured
    p, d, b = stand_in(dev_mode=True), stand_in(dev_mode=True), stand_in(dev_mode=True)
    with pytest.raises(Stop):
        main(attach_argv(p, d, "--baseline-url", b, "--run-dir", str(tmp_path / "run")))
    cfg, attach = got["cfg"], got["attach"]
    # before: cpu, float32, the CPU threshold and 512 tokens, from the harness's own host
    assert (cfg.device, cfg.dtype, cfg.model_len, cfg.model) == ("gpu", "bfloat16", 4096, TINYLLAMA)
    assert cfg.logprob_limit == LOGPROB_THRESHOLD["gpu"]
    assert attach.sources["device"] == "the servers' /server_info" and len(attach.served) == 3
    assert attach.to_dict()["served"][1]["cache"]["num_gpu_blocks"] == "9000"


def test_a_device_nobody_can_tell_is_a_one_line_refusal(stand_in, remote, captured, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(attach_argv(stand_in(), stand_in(), "--run-dir", str(run_dir))) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "give --device cpu or --device gpu" in err and "VLLM_SERVER_DEV_MODE=1" in err
    assert not run_dir.exists() and not captured[0]


def test_a_device_given_is_taken_and_a_contradicted_one_refused(stand_in, remote, captured, tmp_path, capsys):
    got, Stop = captured
    with pytest.raises(Stop):
        main(attach_argv(stand_in(), stand_in(), "--baseline-url", stand_in(), "--device", "gpu", "--dtype", "float16"))
    assert (got["cfg"].device, got["cfg"].dtype, got["attach"].sources["device"]) == ("gpu", "float16", "--device")
    gpu = stand_in(dev_mode=True)
    assert main(attach_argv(gpu, gpu, "--baseline-url", gpu, "--device", "cpu", "--run-dir", str(tmp_path / "r"))) == 2
    assert "--device cpu, but the attached servers report device gpu" in capsys.readouterr().err


def test_settings_rules():
    gpu = [
        Served("http://10.0.0.5:8000", "m", "m", 4096, "gpu", "bfloat16"),
        Served("http://10.0.0.6:8000", "m", "m", 2048, "gpu", "bfloat16"),
    ]
    att = Attach(("http://10.0.0.5:8000",), ("http://10.0.0.6:8000",), None, tuple(gpu))
    s = attach_settings(att, None, None, None, None, lambda: "cpu")
    assert (s.model, s.device, s.dtype, s.max_model_len, s.baseline_here) == ("m", "gpu", "bfloat16", 2048, True)
    with pytest.raises(ConfigError, match="serves at most 2048 tokens"):
        attach_settings(att, None, None, None, 4096, lambda: "cpu")
    with pytest.raises(ConfigError, match="different devices"):
        mixed = (gpu[0], Served(gpu[1].url, "m", "m", device="cpu"))
        attach_settings(Attach(att.prefill_urls, att.decode_urls, None, mixed), None, None, None, None, lambda: "cpu")
    with pytest.raises(ConfigError, match="--dtype float32, but the attached servers serve bfloat16"):
        attach_settings(att, None, None, "float32", None, lambda: "cpu")
    # servers on this host share its hardware: its default applies when they do not say
    local = Attach(
        ("http://127.0.0.1:1",),
        ("http://localhost:2",),
        None,
        (Served("http://127.0.0.1:1", "m"), Served("http://localhost:2", "m")),
    )
    assert attach_settings(local, None, None, None, None, lambda: "gpu").device == "gpu"
    with pytest.raises(ConfigError, match="cannot tell which model"):
        unread = Served("http://b", unread=("GET http://b/v1/models: 503",))
        attach_settings(Attach(("http://a",), ("http://b",), None, (unread,)), None, "cpu", None, None, lambda: "cpu")


def test_a_local_baseline_on_gpu_gets_a_placement_of_its_own(stand_in, remote, monkeypatch, tmp_path):
    from harness.run.pipeline import PDRun

    monkeypatch.setattr("harness.gpu.nvml._real_nvml", lambda: FakeNvml([gpus(4)]))
    d = stand_in(dev_mode=True)
    attach = read_attached(Attach((stand_in(dev_mode=True),), (d,)))
    s = attach_settings(attach, None, None, None, None, lambda: "cpu")
    cfg = E2EConfig(
        device=s.device, model=s.model, dtype=s.dtype, max_model_len=s.max_model_len, tp_d=2, run_dir=tmp_path / "run"
    )
    run = PDRun(cfg, attach=attach)
    run._resolve()
    plan = run.report.config["gpu_plan"]
    assert [s["role"] for s in plan["servers"]] == ["baseline"] and plan["order"] == ["baseline"]
    assert run.ctx.gpu is not None
    base = run.ctx.gpu.placement("baseline")
    assert base.tp == 2 and len(base.gpus) == 2 and base.gpu_memory_utilization == 0.9
    assert run.report.config["attach"]["served"][1]["device"] == "gpu"
    run.ctx.gpu.before("pd")  # nothing of P/D runs here: nothing to check


def test_a_local_baseline_this_host_cannot_run_stops_at_preflight(stand_in, remote, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr("harness.gpu.nvml._real_nvml", lambda: FakeNvml(init_error="Driver Not Loaded"))
    gpu = stand_in(dev_mode=True)
    run_dir = tmp_path / "run"
    assert main(attach_argv(gpu, gpu, "--run-dir", str(run_dir))) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "error: the baseline runs here (no --baseline-url): --device gpu, but the GPUs cannot be read"
    )
    elsewhere = stand_in(dev_mode=True, root="/models/on-the-gpu-node")
    assert main(attach_argv(elsewhere, elsewhere, "--run-dir", str(run_dir))) == 2
    err = capsys.readouterr().err
    assert "the baseline runs here (no --baseline-url), but model folder /models/on-the-gpu-node does not exist" in err
    assert err.count("\n") == 1 and not run_dir.exists()


def test_a_hand_given_share_is_the_local_baselines_alone():
    from harness.run.preflight import attached_baseline_gpu

    # 2 GPUs for a baseline at TP 2: the pair GpuRun plans beside it is colocated, yet 0.8 is the baseline's own share
    cfg = E2EConfig(device="gpu", model=TINYLLAMA, tp_d=2, gpu_memory_utilization=0.8)
    gpu = attached_baseline_gpu(cfg, TINYLLAMA, nvml=FakeNvml([gpus(2)]))
    assert gpu.placement("baseline").gpu_memory_utilization == 0.8 and len(gpu.plan.servers) == 1
    with pytest.raises(ConfigError, match="the baseline runs here .* needs"):
        attached_baseline_gpu(
            E2EConfig(device="gpu", model=TINYLLAMA, gpu_memory_utilization=0.01), TINYLLAMA, nvml=FakeNvml([gpus(1)])
        )


def test_a_local_baseline_takes_a_gpu_a_colocated_pair_could_not_share():
    from harness.run.preflight import attached_baseline_gpu

    # TinyLlama needs ~6.3 GiB per rank: 0.9 x 10 GiB holds the baseline alone; half of that (a pair's share) would not
    cfg = E2EConfig(device="gpu", model=TINYLLAMA)
    gpu = attached_baseline_gpu(cfg, TINYLLAMA, nvml=FakeNvml([gpus(1, total_gib=10.0, free_gib=9.8)]))
    base = gpu.placement("baseline")
    assert (
        base.gpus == (0,) and base.gpu_memory_utilization == 0.9 and [s.role for s in gpu.plan.servers] == ["baseline"]
    )
    assert gpu.plan.order == ("baseline",) and not gpu.plan.colocated
    gpu.before("pd")  # P and D run elsewhere: nothing of theirs to check here
    gpu.after("pd", [])
    assert gpu.checks == []
    gpu.before("baseline")
    assert [c.name for c in gpu.checks] == ["gpu_free_before_baseline"]
    with pytest.raises(
        ConfigError,
        match=r"the baseline runs here .*no GPU placement for the baseline at TP1: "
        r"baseline0 \(TP 1\) needs",
    ):
        attached_baseline_gpu(cfg, TINYLLAMA, nvml=FakeNvml([gpus(1, total_gib=6.0, free_gib=5.8)]))


# -- what attach mode knows of TP and the servers' cache settings, or says it does not (issue 37) ----------------------
UPSTREAM_CACHE = (
    'vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",engine="0",'
    'num_gpu_blocks="900"} 1.0\n'
)  # vLLM's own defaults on CPU, as upstream's scripts start a pair


def test_a_tp_neither_served_nor_given_is_unknown_in_the_progress_line_and_the_report(
    stand_in, remote, captured, tmp_path
):
    from harness.core import progress
    from harness.run.pipeline import PDRun as FakeRun
    from harness.run.report import write_report

    got, Stop = captured
    p, d = stand_in(cache=UPSTREAM_CACHE), stand_in(cache=UPSTREAM_CACHE)
    with pytest.raises(Stop):
        main(attach_argv(p, d, "--device", "cpu", "--dtype", "float32", "--run-dir", str(tmp_path / "run")))
    cfg, attach = got["cfg"], got["attach"]
    assert cfg.tp_unknown == ("tp_p", "tp_d") and cfg.to_dict()["tp_d"] == "unknown (not served)"
    assert attach.sources["tp_d"].startswith("unknown (not served)") and "--tp-d" in attach.sources["tp_d"]
    assert attach.sources["baseline_tp"].startswith("a guess: TP 1")
    assert FakeRun is not RealPDRun
    out = io.StringIO()
    old = progress.use(progress.Progress(out, tty=False, ticker=False))
    try:
        run = RealPDRun(cfg, attach=attach)
        run._resolve()
    finally:
        progress.use(old)
    assert "run P TP unknown (not served) -> D TP unknown (not served) on cpu" in out.getvalue()
    d = write_report(run.report, run.run_dir)
    assert (d["config"]["tp_p"], d["config"]["tp_d"]) == ("unknown (not served)", "unknown (not served)")
    assert {x["setting"]: x for x in d["config"]["attach"]["differences"]} == {
        "block size": {"setting": "block size", "baseline": "32", "servers": {"prefill": "128", "decode": "128"}},
        "prefix caching": {
            "setting": "prefix caching",
            "baseline": "off",
            "servers": {"prefill": "on", "decode": "on"},
        },
    }
    md = (run.run_dir / "report.md").read_text()
    assert "# P/D run: P TP unknown (not served) -> D TP unknown (not served)" in md and "TP1" not in md
    assert "- block size: the baseline 32; prefill 128, decode 128" in md
    assert "- prefix caching: the baseline off; prefill on, decode on" in md
    assert "- the baseline's TP: a guess: TP 1, since D's TP is unknown (not served)" in md


def test_a_tp_given_by_flag_or_upstream_variable_is_known_and_named(stand_in, remote, captured, monkeypatch):
    got, Stop = captured
    p, d, b = stand_in(), stand_in(), stand_in()
    with pytest.raises(Stop):
        main(attach_argv(p, d, "--baseline-url", b, "--device", "cpu", "--tp-p", "1", "--tp-d", "2"))
    cfg, attach = got["cfg"], got["attach"]
    assert (cfg.tp_p, cfg.tp_d, cfg.tp_unknown, cfg.tp_label("tp_d")) == (1, 2, (), "TP2")
    assert (attach.sources["tp_p"], attach.sources["tp_d"]) == ("--tp-p", "--tp-d")
    monkeypatch.setenv("DECODER_TP_SIZE", "2")
    with pytest.raises(Stop):
        main(attach_argv(p, d, "--baseline-url", b, "--device", "cpu"))
    cfg, attach = got["cfg"], got["attach"]
    assert (cfg.tp_d, cfg.tp_unknown, attach.sources["tp_d"]) == (2, ("tp_p",), "$DECODER_TP_SIZE")
    assert cfg.to_dict()["tp_p"] == "unknown (not served)" and cfg.to_dict()["tp_d"] == 2


def test_a_tp_served_at_server_info_is_read_and_a_contradicting_flag_refused(stand_in, remote, captured, capsys):
    got, Stop = captured
    p, d = stand_in(dev_mode=True, tp=1), stand_in(dev_mode=True, tp=2)
    b = stand_in(dev_mode=True, tp=2)
    with pytest.raises(Stop):
        main(attach_argv(p, d, "--baseline-url", b))
    cfg, attach = got["cfg"], got["attach"]
    assert (cfg.tp_p, cfg.tp_d, cfg.tp_unknown) == (1, 2, ())
    assert attach.sources["tp_d"] == "the decode servers' /server_info" and attach.served[1].tp == 2
    assert main(attach_argv(p, d, "--baseline-url", b, "--tp-d", "1")) == 2
    assert "--tp-d 1, but the attached decode servers serve TP 2" in capsys.readouterr().err


def test_every_setting_the_baseline_and_the_attached_servers_differ_in_is_listed():
    from harness.run.attach_report import attach_report

    upstream = {"block_size": "128", "enable_prefix_caching": "True", "cache_dtype": "auto"}
    served = (
        Served("http://p:1", "m", cache=upstream),
        Served("http://d:2", "m", cache=upstream),
        Served("http://d:3", "m", unread=("GET http://d:3/metrics: ConnectionError",)),
    )
    attach = Attach(("http://p:1",), ("http://d:2", "http://d:3"), None, served)
    cfg = E2EConfig(tp_p=1, tp_d=2, device="cpu")  # TP given; the baseline launched here at D's TP, block size 32
    report = attach_report(cfg, attach)
    assert report["differences"] == [
        {"setting": "block size", "baseline": "32", "servers": {"prefill": "128", "decode[0]": "128"}},
        {"setting": "prefix caching", "baseline": "off", "servers": {"prefill": "on", "decode[0]": "on"}},
        {"setting": "TP", "baseline": "2", "servers": {"prefill": "1"}},
    ]
    assert report["not_compared"] == [
        "block size of decode[1]: its /metrics was not read",
        "prefix caching of decode[1]: its /metrics was not read",
        "KV cache dtype of decode[1]: its /metrics was not read",
    ]
    # TP unknown: no TP is compared, and the baseline's own is named a guess; an fp8 baseline differs in KV dtype
    cfg = E2EConfig(device="cpu", tp_unknown=("tp_p", "tp_d"), axes=ServerAxes(kv_cache_dtype="fp8"))
    report = attach_report(cfg, Attach(("http://p:1",), ("http://d:2",), None, served[:2]))
    assert [x["setting"] for x in report["differences"]] == ["block size", "prefix caching", "KV cache dtype"]
    assert report["not_compared"] == [
        "TP of the baseline: the baseline runs at TP 1, a guess: D's TP is unknown (not served)"
    ]


def test_the_health_grace_is_a_positive_number_of_seconds_for_attach_mode(stand_in, remote, captured, capsys, tmp_path):
    got, Stop = captured
    p, d, b = stand_in(), stand_in(), stand_in()
    with pytest.raises(Stop):
        main(attach_argv(p, d, "--baseline-url", b, "--device", "cpu"))
    assert got["cfg"].health_grace_s == 30.0  # generous by default
    with pytest.raises(Stop):
        main(attach_argv(p, d, "--baseline-url", b, "--device", "cpu", "--health-grace", "45"))
    assert got["cfg"].health_grace_s == 45.0
    for bad in ("0", "-3", "soon"):
        with pytest.raises(SystemExit) as e:
            main(attach_argv(p, d, "--baseline-url", b, "--device", "cpu", "--health-grace", bad))
        assert e.value.code == 2 and "--health-grace" in capsys.readouterr().err
    assert main(["e2e", "--health-grace", "5", "--run-dir", str(tmp_path / "run")]) == 2
    assert "--health-grace is for attach mode" in capsys.readouterr().err and not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="health grace must be > 0"):
        E2EConfig(health_grace_s=float("nan")).validate()
