"""repro_client.py: the small Python side of repro.sh (standard library only; copied into every bundle as is).

  ports SIZE...             free blocks of consecutive ports on 127.0.0.1, one base per size
  wait URL PID LOG          until URL/health answers 200 (or the process exits, or the timeout)
  send P_URL D_URL FILE     each request of FILE to P (prefill, max_tokens 1), then to D with P's kv_transfer_params
  verdict PATTERN LOG...    REPRODUCED with the first matching log line, else NOT REPRODUCED / INCONCLUSIVE
"""

import argparse
import json
import os
import random
import re
import socket
import sys
import time
import urllib.error
import urllib.request
import uuid

PREFILL_KV_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                     "remote_block_ids": None, "remote_host": None, "remote_port": None}


def bindable(port):
    for host in ("127.0.0.1", ""):  # vLLM binds some ports on all interfaces
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def ports(sizes):
    taken, out = set(), []
    rng = random.Random()
    for size in sizes:
        for _ in range(2000):
            base = rng.randrange(20000, 32000 - size)
            block = range(base, base + size)
            if not taken.intersection(block) and all(bindable(p) for p in block):
                taken.update(block)
                out.append(base)
                break
        else:
            sys.exit(f"no {size} consecutive free ports")
    print(" ".join(map(str, out)))
    return 0


def post(url, body, rid, timeout):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "X-Request-Id": rid})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except Exception as e:  # a timeout or a refused connection is an answer too
        return None, f"{type(e).__name__}: {e}"


def first_match(pattern, logs):
    rx = re.compile(pattern, re.IGNORECASE)
    for log in logs:
        try:
            with open(log, errors="replace") as f:
                for line in f:
                    if rx.search(line):
                        return log, line.rstrip()
        except OSError:
            pass
    return None


def wait(url, pid, log, timeout, pattern):
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    print(f"  ready after {time.time() - t0:.0f} s: {url}")
                    return 0
        except Exception:
            pass
        try:
            os.kill(pid, 0)
        except OSError:
            print(f"  the server of {url} exited before it was ready (log {log})")
            return 1
        if pattern and first_match(pattern, [log]):  # the failure can come before readiness (a handshake at start-up)
            print(f"  the looked-for line is in {log} before {url} became ready")
            return 1
        time.sleep(2)
    print(f"  {url} not ready within {timeout:.0f} s (log {log})")
    return 1


def send(p_url, d_url, path, timeout, out):
    results = []
    for i, body in enumerate(json.load(open(path))):
        rid = f"repro-{i}-{uuid.uuid4().hex[:8]}"
        p_body = dict(body, max_tokens=1, stream=False, kv_transfer_params=dict(PREFILL_KV_PARAMS))
        t0 = time.time()
        status, text = post(p_url + "/v1/completions", p_body, rid, timeout)
        print(f"  request {i}: P answered HTTP {status} in {time.time() - t0:.2f} s")
        r = {"request": i, "prefill_status": status, "decode_status": None, "decode_text": None}
        kv = None
        if status == 200:
            kv = json.loads(text).get("kv_transfer_params")
            if not kv:
                print("  P's answer carries no kv_transfer_params: no KV transfer can happen")
        else:
            print(f"  P: {text[:300]}")
        if kv:
            t0 = time.time()
            status, text = post(d_url + "/v1/completions", dict(body, kv_transfer_params=kv), rid, timeout)
            r["decode_status"] = status
            shown = text
            if status == 200:
                shown = json.loads(text)["choices"][0]["text"]
                r["decode_text"] = shown
            print(f"  request {i}: D answered HTTP {status} in {time.time() - t0:.2f} s: {shown[:300]!r}")
        results.append(r)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


def verdict(pattern, logs, answers, wait_s):
    deadline = time.time() + wait_s
    while True:
        hit = first_match(pattern, logs)
        if hit:
            print(f"REPRODUCED: {os.path.basename(hit[0])}: {hit[1].strip()}")
            return 0
        if time.time() >= deadline:
            break
        time.sleep(1)
    try:
        results = json.load(open(answers))
    except (OSError, ValueError):
        results = []
    served = [r for r in results if r.get("decode_status") == 200]
    if results and len(served) == len(results):
        print(f"NOT REPRODUCED: no line matching /{pattern}/ in {', '.join(map(os.path.basename, logs))}; "
              f"P handed over KV and D answered all {len(served)} request(s) (HTTP 200)")
        return 1
    print(f"INCONCLUSIVE: no line matching /{pattern}/, and the requests did not get through "
          f"({len(served)} of {len(results)} answered by D); see the logs: {', '.join(logs)}")
    return 3


def main(argv):
    ap = argparse.ArgumentParser(prog="repro_client.py")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("ports")
    p.add_argument("sizes", nargs="+", type=int)
    w = sub.add_parser("wait")
    w.add_argument("url")
    w.add_argument("pid", type=int)
    w.add_argument("log")
    w.add_argument("--timeout", type=float, default=600)
    w.add_argument("--pattern")
    s = sub.add_parser("send")
    s.add_argument("p_url")
    s.add_argument("d_url")
    s.add_argument("requests")
    s.add_argument("--timeout", type=float, default=180)
    s.add_argument("--out", required=True)
    v = sub.add_parser("verdict")
    v.add_argument("pattern")
    v.add_argument("logs", nargs="+")
    v.add_argument("--answers", required=True)
    v.add_argument("--wait", type=float, default=5)
    a = ap.parse_args(argv)
    if a.cmd == "ports":
        return ports(a.sizes)
    if a.cmd == "wait":
        return wait(a.url, a.pid, a.log, a.timeout, a.pattern)
    if a.cmd == "send":
        return send(a.p_url, a.d_url, a.requests, a.timeout, a.out)
    return verdict(a.pattern, a.logs, a.answers, a.wait)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
