"""Simulated GPU boxes with processes on them (issue 23): the claims stand-in servers register, the simulated NVML
that shows them, the stand-in server itself (its GPUs, its memory check, its OpenAI answers), and the launch path
that puts a stand-in in vLLM's place under PD_HARNESS_SIMULATED_GPUS."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import ThreadingHTTPServer

import pytest
import requests

from harness.checks.leak import state_of
from harness.core.paths import REPO_ROOT
from harness.gpu.nvml import discover
from harness.gpu.run import GpuRun
from harness.run.config import E2EConfig
from harness.run.launch import STANDIN_MODULE, WantedServer, make_server, simulated_spec
from harness.serve.ports import PortAllocator
from harness.serve.prometheus import parse_metrics
from harness.simbox import standin
from harness.simbox import standin_model as model
from harness.simbox.box import SIMULATED_ENV, parse_box
from harness.simbox.claims import STATE_ENV, Claim, box_state, live_claims, proc_start, register, release
from harness.workload.client import GenerationSettings, run_completions
from harness.workload.completion import parse_completion
from harness.workload.load_client import _Stream
from harness.workload.prompts import prompt_set
from tests.unit.gpu.fake_nvml import FakeNvml, gpus

TINYLLAMA = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"


@pytest.fixture(autouse=True)
def no_caller_settings(monkeypatch):
    for name in (SIMULATED_ENV, STATE_ENV, "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "GPU_MEMORY_UTILIZATION"):
        monkeypatch.delenv(name, raising=False)


def me(gpus_: tuple[int, ...], gib: float) -> Claim:
    return Claim(os.getpid(), proc_start(os.getpid()) or "", gpus_, gib, "test")


def box_env(tmp_path, spec: str = "8x80", **more: str) -> dict[str, str]:
    return {SIMULATED_ENV: spec, STATE_ENV: str(tmp_path / "box"), **more}


# --- claims: what runs on a simulated box ---


def test_a_live_claim_counts_and_dead_or_reused_pids_do_not(tmp_path):
    folder = tmp_path / "box"
    register(folder, me((0, 1), 36.0))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    register(folder, Claim(dead.pid, "123", (2,), 10.0))  # exited (and reaped): its memory is back
    register(folder, Claim(1, "not-init's-start-time", (3,), 10.0))  # PID reused by another process
    (folder / "garbage.json").write_text("{not json")
    assert [c.pid for c in live_claims(folder)] == [os.getpid()]
    release(folder, os.getpid())
    assert live_claims(folder) == [] and live_claims(tmp_path / "absent") == [] and live_claims(None) == []


def test_the_box_shows_its_processes_and_their_memory(tmp_path):
    register(tmp_path / "box", me((0, 1), 36.0))
    d = discover(env=box_env(tmp_path))
    by = d.by_index()
    assert by[0].pids == (os.getpid(),) and by[0].free_gib == pytest.approx(79.5 - 36.0)
    assert by[2].pids == () and by[2].free_gib == pytest.approx(79.5)
    release(tmp_path / "box", os.getpid())
    assert discover(env=box_env(tmp_path)).by_index()[0].free_gib == pytest.approx(79.5)


def test_memory_never_goes_below_zero_and_free_option_applies(tmp_path):
    register(tmp_path / "box", me((0,), 50.0))
    assert discover(env=box_env(tmp_path, "8x80:free=30")).by_index()[0].free_gib == 0.0


def test_a_child_reads_the_box_through_its_own_visible_devices():
    assert parse_box("8x80:visible=4,5,6,7:free=30").for_child() == "8x80:free=30"
    assert parse_box("8x40").for_child() == "8x40"


def test_box_state_is_named_once_and_exported(tmp_path):
    env: dict[str, str] = {}
    path = box_state(env)
    assert env[STATE_ENV] == str(path) and str(os.getpid()) in path.name
    assert box_state(env) == path
    assert box_state({STATE_ENV: str(tmp_path)}) == tmp_path


def test_gpu_run_keeps_each_nvml_check_it_made():
    run = GpuRun(1, 1, TINYLLAMA, nvml=FakeNvml([gpus(2)]), sleep=lambda s: None)
    run.before("baseline")
    run.after("baseline", [123])
    names = [c.name for c in run.checks]
    assert names == ["gpu_free_before_baseline", "gpu_released_after_baseline"] and all(c.passed for c in run.checks)
    assert "GPU 1" in run.checks[0].detail and run.simulated is None and run.plan.simulated is None


def test_gpu_run_on_a_simulated_box_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv(SIMULATED_ENV, "8x40")
    run = GpuRun(2, 8, TINYLLAMA)
    assert run.simulated == "8x40" and run.plan.to_dict()["simulated"] == "8x40"


# --- the stand-in's model and answers (pure) ---


def test_answers_depend_on_the_prompt_ids_only():
    ids = model.tokenize("The capital of France is")
    assert ids[0] == model.BOS and len(ids) == 6
    assert model.generate(ids, 8, 5) == model.generate(list(ids), 8, 5)
    assert model.generate(ids, 8, 5) != model.generate(ids[:-1], 8, 5)
    one = model.generate(ids, 3, 5)
    assert all(len(s.top) == 5 and s.top[0] == (s.token, s.logprob) for s in one)
    assert all(len({t for t, _ in s.top}) == 5 for s in one)  # k distinct candidates
    assert model.Request.from_body({"prompt": [[7, 8, 9]]}).ids == [7, 8, 9]  # a batch of one
    assert model.prompt_ids("a b") == model.tokenize("a b")


def test_a_completion_parses_as_the_harness_parses_vllms():
    body = {"prompt": "hello there", "max_tokens": 4, "logprobs": 5, "return_tokens_as_token_ids": True}
    req = model.Request.from_body(body)
    steps = model.generate(req.ids, 4, 5)
    c = parse_completion("p", model.completion_body("r1", "m", req, steps, None))
    assert c.token_ids == tuple(s.token for s in steps) and c.prompt_tokens == 3
    assert all(len(t) == 5 for t in c.top_logprobs) and c.finish_reason == "length"
    streamed = _Stream()
    for chunk in model.stream_chunks(
        "r1", "m", model.Request.from_body({**body, "stream": True, "stream_options": {"include_usage": True}}), steps
    ):
        streamed.feed(b"data: " + json.dumps(chunk).encode())
    assert streamed.feed(b"data: [DONE]")
    s = parse_completion("p", streamed.answer())
    assert (s.token_ids, s.top_logprobs, s.prompt_tokens) == (c.token_ids, c.top_logprobs, c.prompt_tokens)


def test_p_hands_kv_transfer_params_only_when_asked():
    asked = model.Request.from_body({"prompt": "a b c", "kv_transfer_params": {"do_remote_decode": True}})
    params = model.prefill_params(asked, "e1", 16, "127.0.0.1", 5600, 2)
    assert params is not None
    assert params["do_remote_prefill"] and params["remote_engine_id"] == "e1" and params["tp_size"] == 2
    assert model.prefill_params(model.Request.from_body({"prompt": "a"}), "e1", 16, "h", 1, 1) is None


def test_metrics_show_an_idle_server_and_no_transfer_evidence():
    text = model.metrics_text("m", 0, 256, 16, {"vllm:prompt_tokens_total": 5.0}, "8x80")
    samples = parse_metrics(text)
    st = state_of(samples)
    assert (st.running, st.waiting, st.kv_usage, st.pool_blocks) == (0, 0, 0, 256)
    assert not any("nixl" in s.name or "by_source" in s.name for s in samples)  # nothing a transfer check could read


# --- the stand-in server ---


def args(*extra: str):
    return standin.parse(["--model", TINYLLAMA, "--port", "0", "--tensor-parallel-size", "2", *extra])


def test_it_takes_the_first_tp_of_its_visible_gpus_by_physical_id(tmp_path):
    ranks, why = standin.take_gpus(
        args("--gpu-memory-utilization", "0.45"),
        box_env(tmp_path, "8x80:visible=4,5,6,7", CUDA_VISIBLE_DEVICES="6,7,4,5"),
    )
    assert why is None and [g.index for g in ranks] == [6, 7]  # its own list, not the harness's visible=


def test_it_refuses_to_start_as_vllm_does_without_the_free_memory(tmp_path):
    register(tmp_path / "box", me((0,), 60.0))
    env = box_env(tmp_path, CUDA_VISIBLE_DEVICES="0,1")
    _, why = standin.take_gpus(args("--gpu-memory-utilization", "0.45"), env)
    assert why is not None and why.startswith("ValueError: Free memory on device cuda:0 (19.50/80.00 GiB)")
    assert str(os.getpid()) in why
    assert standin.take_gpus(args("--gpu-memory-utilization", "0.2"), env)[1] is None
    _, why = standin.take_gpus(args(), box_env(tmp_path, CUDA_VISIBLE_DEVICES="3"))
    assert "tensor parallel size 2 needs 2 GPUs, 1 visible" in (why or "")
    assert "No CUDA GPUs" in (standin.take_gpus(args(), box_env(tmp_path, "unreadable"))[1] or "")
    assert SIMULATED_ENV in (standin.take_gpus(args(), {})[1] or "")


@pytest.fixture
def server():
    a = args("--kv-transfer-config", '{"kv_role":"kv_producer"}', "--max-model-len", "64")
    handler = type("H", (standin.Handler,), {"standin": standin.StandIn(a, "8x80")})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_the_server_answers_what_the_harness_asks(server):
    assert requests.get(f"{server}/health").status_code == 200
    card = requests.get(f"{server}/v1/models").json()["data"][0]
    assert card["id"] == card["root"] == TINYLLAMA and card["max_model_len"] == 64
    ids = requests.post(f"{server}/tokenize", json={"prompt": "one two"}).json()["tokens"]
    assert ids == model.tokenize("one two")
    prompts = prompt_set(0)[:3]
    run = run_completions(server, TINYLLAMA, prompts, GenerationSettings(max_tokens=4, logprobs=5))
    assert not run.failures and [len(c.token_ids) for c in run.completions] == [4, 4, 4]
    again = run_completions(server, TINYLLAMA, prompts, GenerationSettings(max_tokens=4, logprobs=5))
    assert [c.token_ids for c in again.completions] == [c.token_ids for c in run.completions]
    kv = requests.post(
        f"{server}/v1/completions",
        json={"prompt": "a b", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    ).json()
    assert kv["kv_transfer_params"]["do_remote_prefill"] is True
    long = requests.post(f"{server}/v1/completions", json={"prompt": [1] * 60, "max_tokens": 16})
    assert long.status_code == 400 and "maximum context length is 64" in long.text
    st = state_of(parse_metrics(requests.get(f"{server}/metrics").text))
    assert st.running == 0 and st.pool_blocks == standin.DEFAULT_POOL_BLOCKS


def test_it_streams_and_survives_a_client_that_goes_away(server):
    body = {
        "prompt": "a b c",
        "max_tokens": 5,
        "logprobs": 2,
        "return_tokens_as_token_ids": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with requests.post(f"{server}/v1/completions", json=body, stream=True) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == b"data: [DONE]" and json.loads(lines[-2][5:])["usage"]["completion_tokens"] == 5
    with requests.post(f"{server}/v1/completions", json={**body, "max_tokens": 500}, stream=True) as r:
        next(r.iter_lines())  # then close mid-stream
    assert requests.get(f"{server}/health").status_code == 200


# --- launch: a stand-in in vLLM's place, only under the switch ---


def test_under_the_switch_a_stand_in_serves_with_vllms_arguments(tmp_path, monkeypatch):
    run = GpuRun(2, 8, TINYLLAMA, nvml=FakeNvml([gpus(8)]))
    cfg = E2EConfig(device="gpu", model=TINYLLAMA, python="python3")
    want = WantedServer(
        role="decode",
        tp=8,
        model=TINYLLAMA,
        served_name=TINYLLAMA,
        block_size=None,
        cpu_bind=None,
        placement=run.placement("decode"),
    )
    with PortAllocator(lock_dir=tmp_path / "locks") as alloc:
        real = make_server(cfg, alloc, want, tmp_path)
        monkeypatch.setenv(SIMULATED_ENV, "8x80")
        monkeypatch.setenv(STATE_ENV, str(tmp_path / "box"))
        sim = make_server(cfg, alloc, want, tmp_path)
    assert real.proc.spec.argv[2] == "vllm.entrypoints.openai.api_server" and "stand-in" not in real.command
    argv = list(sim.proc.spec.argv)
    flags = [x for x in argv[3:] if x.startswith("--")]
    assert argv[1:3] == ["-m", STANDIN_MODULE] and flags == [x for x in real.proc.spec.argv[3:] if x.startswith("--")]
    assert argv[argv.index("--gpu-memory-utilization") + 1] == str(run.placement("decode").gpu_memory_utilization)
    env = sim.proc.spec.env
    assert env["CUDA_VISIBLE_DEVICES"] == run.placement("decode").cuda_visible_devices
    assert env[STATE_ENV] == str(tmp_path / "box") and env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO_ROOT)
    assert "vllm.entrypoints.openai.api_server" in sim.command and "served by a stand-in" in sim.command
    assert "PD_HARNESS_SIMULATED_GPUS=8x80" in sim.command


@pytest.mark.parametrize(
    "device, spec, expected",
    [("gpu", "8x80", "8x80"), ("cpu", "8x80", None), ("gpu", "unreadable", None), ("gpu", "nonsense", None)],
)
def test_which_runs_are_simulated(monkeypatch, device, spec, expected):
    monkeypatch.setenv(SIMULATED_ENV, spec)
    assert simulated_spec(E2EConfig(device=device, model=TINYLLAMA)) == expected


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_a_stand_in_holds_its_memory_while_it_lives(tmp_path, sig):
    import signal
    import time

    from harness.serve.ports import PortAllocator as Ports

    env = {**os.environ, **box_env(tmp_path), "CUDA_VISIBLE_DEVICES": "2,3", "PYTHONPATH": str(REPO_ROOT)}
    with Ports(lock_dir=tmp_path / "locks") as alloc:
        port = alloc.port()
        p = subprocess.Popen(
            [
                sys.executable,
                "-m",
                STANDIN_MODULE,
                "--model",
                TINYLLAMA,
                "--port",
                str(port),
                "--tensor-parallel-size",
                "2",
                "--gpu-memory-utilization",
                "0.5",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            deadline = time.monotonic() + 30
            while not live_claims(tmp_path / "box") and time.monotonic() < deadline and p.poll() is None:
                time.sleep(0.05)
            by = discover(env=box_env(tmp_path)).by_index()
            assert by[2].pids == (p.pid,) and by[3].free_gib == pytest.approx(79.5 - 40.0) and by[0].pids == ()
        finally:
            p.send_signal(getattr(signal, sig))
            out = p.communicate(timeout=30)[0]
    assert "NOT vLLM" in out and "holding 40.0 GiB on each of GPUs 2,3" in out
    assert discover(env=box_env(tmp_path)).by_index()[2].free_gib == pytest.approx(79.5)  # released, or its PID dead
    assert (tmp_path / "box" / f"{p.pid}.json").exists() == (sig == "SIGKILL")
