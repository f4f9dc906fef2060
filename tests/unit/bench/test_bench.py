"""Benchmarks: the pure parts (percentiles, ratios, result shape), the bench backend's answers, and small real runs
that check the output shape only. No timing is asserted anywhere."""

import json
import subprocess
import sys

import pytest

from harness.bench.backend import KV_TRANSFER_PARAMS, State
from harness.bench.proxy import (
    LatencyStats,
    Level,
    TargetResult,
    direct_target,
    percentile,
    ratio,
    render,
    summarize,
    target_checks,
)
from harness.core.paths import REPO_ROOT


def test_percentile_interpolates_between_ranks():
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([1, 2, 3, 4], 0) == 1 and percentile([1, 2, 3, 4], 100) == 4
    assert percentile([7], 99) == 7
    assert percentile(list(range(101)), 99) == pytest.approx(99)
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_ratio():
    assert ratio(300, 100) == 3 and ratio(None, 100) is None and ratio(5, 0) is None and ratio(5, None) is None


def level(c: int, completed: int, elapsed: float) -> Level:
    return Level(
        concurrency=c, requested=completed, completed=completed, errors=0, elapsed_s=elapsed, hit_time_limit=False
    )


def result(name: str, lat_s: list[float], rps_by_c: dict[int, list[float]]) -> TargetResult:
    r = TargetResult(name, LatencyStats.of(lat_s))
    r.levels = {c: [level(c, int(x * 10), 10.0) for x in xs] for c, xs in rps_by_c.items()}
    return r


def test_throughput_is_the_median_of_rounds():
    r = result("t", [0.001], {1: [100, 300, 200], 10: [50]})
    assert r.throughput_rps() == {1: 200, 10: 50}
    assert level(1, 0, 0).rps == 0


def summary(concurrency=(1, 10, 100)):
    direct = result("direct", [0.0002] * 10, {c: [5000] for c in concurrency})
    toy = result("toy", [0.0007] * 9 + [0.003], {c: [900] for c in concurrency})
    ref = result("reference", [0.003] * 10, {c: [300] for c in concurrency})
    cfg = {
        "requests": 10,
        "concurrency": list(concurrency),
        "rounds": 1,
        "time_limit_s": 5.0,
        "load_average_before": [0.1, 0, 0],
    }
    return summarize(direct, toy, ref, cfg)


def test_summary_shape_added_latency_and_ratios():
    d = summary()
    assert json.loads(json.dumps(d)) == d
    toy, ref = d["proxies"]["toy"], d["proxies"]["reference"]
    for p in (toy, ref):
        assert {"p50_added_ms", "p99_added_ms", "throughput_rps", "throughput_ratio_vs_reference"} <= set(p)
        assert set(p["throughput_rps"]) == set(p["throughput_ratio_vs_reference"]) == {"1", "10", "100"}
    assert toy["p50_added_ms"] == pytest.approx(0.5)
    assert toy["p99_added_ms"] > toy["p50_added_ms"]
    assert toy["throughput_ratio_vs_reference"]["100"] == pytest.approx(3.0)
    assert ref["throughput_ratio_vs_reference"] == {"1": 1.0, "10": 1.0, "100": 1.0}
    assert [(t["name"], t["met"]) for t in d["targets"]] == [
        ("toy_p50_added_ms_at_c1", True),
        ("toy_throughput_ratio_at_c100", True),
    ]
    assert "MET" in render(d)


def test_targets_missed_or_not_measured():
    d = summary(concurrency=(1, 4))
    checks = {t.name: t for t in target_checks(d)}
    assert checks["toy_throughput_ratio_at_c100"].met is None and checks["toy_throughput_ratio_at_c100"].value is None
    assert "not measured" in render(d)
    d["proxies"]["toy"]["p50_added_ms"] = 1.5
    assert target_checks(d)[0].met is False


def answer(state: State, path: str, body: dict) -> tuple[bytes, bytes]:
    raw = state.answer("POST", path, json.dumps(body).encode(), "rid")
    head, _, payload = raw.partition(b"\r\n\r\n")
    return head, payload


def test_bench_backend_answers_like_p_and_d():
    s = State(0, None, 3)
    head, payload = answer(s, "/v1/completions", {"prompt": "x", "kv_transfer_params": {"do_remote_decode": True}})
    assert head.startswith(b"HTTP/1.1 200") and b"x-request-id: rid" in head
    assert json.loads(payload)["kv_transfer_params"] == KV_TRANSFER_PARAMS
    head, payload = answer(s, "/v1/chat/completions", {"messages": [], "kv_transfer_params": KV_TRANSFER_PARAMS})
    assert "kv_transfer_params" not in json.loads(payload) and json.loads(payload)["choices"][0]["message"]["content"]
    head, payload = answer(s, "/v1/completions", {"prompt": "x", "stream": True})
    assert b"transfer-encoding: chunked" in head and payload.count(b"data: ") == 4 and payload.endswith(b"0\r\n\r\n")
    assert s.counts == {"prefill": 1, "decode": 2, "bad": 0}
    assert s.answer("POST", "/v1/completions", b"{bad", None).startswith(b"HTTP/1.1 400")
    assert s.answer("GET", "/nope", b"", None).startswith(b"HTTP/1.1 404")
    assert b'role="decode"} 2' in s.answer("GET", "/metrics", b"", None)


def test_bench_backend_health_and_ready_file(tmp_path):
    f = tmp_path / "ready"
    s = State(3, str(f), 1)
    assert s.answer("GET", "/health", b"", None).startswith(b"HTTP/1.1 503")
    s.mark_ready()
    assert s.answer("GET", "/health", b"", None).startswith(b"HTTP/1.1 200")
    assert float(f.read_text()) > 0


def test_direct_target_makes_the_two_hops_a_proxy_makes():
    t = direct_target("127.0.0.1", 1)
    p, d = (json.loads(h.partition(b"\r\n\r\n")[2]) for h in t.hops)
    assert p["kv_transfer_params"]["do_remote_decode"] is True and p["max_tokens"] == 1
    assert d["kv_transfer_params"] == KV_TRANSFER_PARAMS and d["max_tokens"] > 1


def test_bench_cli_rejects_bad_levels():
    from harness.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "proxy", "--concurrency", "1,x"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "proxy", "--concurrency", "0"])
    assert build_parser().parse_args(["bench", "proxy", "--concurrency", "1,4"]).concurrency == [1, 4]


def run_cli(*args: str, timeout: float = 240) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "harness", "bench", *args, "--json"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_bench_proxy_real_small_run(tmp_path):
    d = run_cli(
        "proxy",
        "--requests",
        "50",
        "--concurrency",
        "1,4",
        "--rounds",
        "1",
        "--warmup",
        "5",
        "--time-limit",
        "30",
        "--log-dir",
        str(tmp_path),
    )
    assert d["config"]["concurrency"] == [1, 4]
    for name in ("toy", "reference"):
        p = d["proxies"][name]
        assert isinstance(p["p50_added_ms"], float) and isinstance(p["p99_added_ms"], float)
        assert set(p["throughput_rps"]) == set(p["throughput_ratio_vs_reference"]) == {"1", "4"}
        assert all(lv["errors"] == 0 for runs in p["runs"].values() for lv in runs)
    assert [t["name"] for t in d["targets"]] == ["toy_p50_added_ms_at_c1", "toy_throughput_ratio_at_c100"]
    assert (tmp_path / "toy_proxy.log").exists() and (tmp_path / "reference_proxy.log").exists()


def test_bench_lifecycle_real_small_run(tmp_path):
    d = run_cli("lifecycle", "--repeats", "1", "--ready-after", "0.5", "--log-dir", str(tmp_path))
    (r,) = d["rounds"]
    assert {"ready_delay_s", "launch_to_ready_s", "teardown_s", "leftovers"} <= set(r)
    assert d["leftover_processes"] == 0
    assert [t["name"] for t in d["targets"]] == ["ready_delay_max_s", "teardown_max_s"]
