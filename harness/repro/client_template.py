"""repro_client.py: the small Python side of repro.sh (standard library only; copied into every bundle as is).

ports SIZE...             free blocks of consecutive ports on 127.0.0.1, one base per size
wait URL PID LOG          until URL/health answers 200 (or the process exits, or the timeout)
send P_URL D_URL FILE     each request of FILE to P (prefill, max_tokens 1), then to D with P's kv_transfer_params
verdict PATTERN LOG...    REPRODUCED with the first matching log line, else NOT REPRODUCED / INCONCLUSIVE
baseline URL FILE         each request of FILE to a plain server, text prompts first turned into token ids by its
                          /tokenize (--ids-out: the requests as sent, for P and D)
compare BASE ANSWERS      D's answers against the plain server's with the run's rule (rule/compare.py, copied
                          from the harness): REPRODUCED / NOT REPRODUCED / INCONCLUSIVE
digest DIR                the replay's KV digest records compared (rule/kv_digest.py, copied from the harness; needs
                          numpy): pass / FAIL with where D first differs / skipped with why; with --run, the run's
                          records too, and whether the replay differs where the run did
"""

import argparse
import dataclasses
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
from pathlib import Path
from typing import Any

PREFILL_KV_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def bindable(port):
    for host in ("127.0.0.1", ""):  # vLLM binds some ports on all interfaces
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def ports(sizes):
    taken: set[int] = set()
    out = []
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
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "X-Request-Id": rid},
    )
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


def items(path):
    """(id, body) of each request of FILE: a bare body (id: its position), or {"id": ..., "body": ...}."""
    with open(path) as f:
        data = json.load(f)
    for i, item in enumerate(data):
        yield (item["id"], item["body"]) if "body" in item else (str(i), item)


def baseline(url, path, timeout, out, ids_out):
    sent, results = [], []
    for pid, body in items(path):
        if isinstance(body.get("prompt"), str):
            status, text = post(
                url + "/tokenize", {"model": body["model"], "prompt": body["prompt"]}, f"tok-{pid}", timeout
            )
            if status != 200:
                print(f"  {pid}: /tokenize answered HTTP {status}: {text[:300]}")
                return 3
            body = dict(body, prompt=json.loads(text)["tokens"])
        status, text = post(url + "/v1/completions", body, f"base-{pid}-{uuid.uuid4().hex[:8]}", timeout)
        print(f"  {pid}: the plain server answered HTTP {status} ({len(body['prompt'])} prompt tokens)")
        r = {"id": pid, "status": status, "response": json.loads(text) if status == 200 else text}
        if status == 200:
            r["control"] = no_pd_control(url, pid, body, r["response"], timeout)
        results.append(r)
        sent.append({"id": pid, "body": body})
    for path_out, data in ((out, results), (ids_out, sent)):
        with open(path_out, "w") as f:
            json.dump(data, f, indent=1)
    return 0


def no_pd_control(url, pid, body, answer, timeout):
    """The plain server alone, two paths to one position: its decode step after the prompt (the answer's 2nd token)
    and a fresh prefill of prompt + the answer's 1st token. D's first token is computed over KV it did not compute
    itself; when the backend's own two paths disagree, P/D need not be to blame."""
    toks = answer["choices"][0]["logprobs"]["tokens"]
    if len(toks) < 2:
        return None
    first = int(toks[0].split(":", 1)[1])
    status, text = post(
        url + "/v1/completions",
        dict(body, prompt=body["prompt"] + [first], max_tokens=1),
        f"ctl-{pid}-{uuid.uuid4().hex[:8]}",
        timeout,
    )
    return {"status": status, "response": json.loads(text) if status == 200 else text}


def control_line(base, top_k, threshold):
    """What the no-P/D control says of one replayed prompt (None: not run)."""
    from completion import parse_completion

    ctl = base.get("control")
    if not ctl or ctl.get("status") != 200:
        return None
    whole = parse_completion(base["id"], base["response"])
    fresh = parse_completion(base["id"], ctl["response"])
    decode_tok, prefill_tok = whole.token_ids[1], fresh.token_ids[0]
    lp_d, lp_p = whole.top_logprobs[1].get(decode_tok), fresh.top_logprobs[0].get(decode_tok)
    delta = abs(lp_d - lp_p) if lp_d is not None and lp_p is not None else None
    shown = "n/a" if delta is None else f"{delta:.3g}"
    if decode_tok == prefill_tok and delta is not None and delta <= threshold:
        return True, f"passes: decode step and fresh prefill agree (token {decode_tok}, |Δlogprob| {shown})"
    return False, (
        f"FAILS: decode step {decode_tok} vs fresh prefill {prefill_tok}, |Δlogprob| {shown} > {threshold:g}: "
        "the backend disagrees with itself without P/D"
    )


def send(p_url, d_url, path, timeout, out):
    results = []
    for i, (pid, body) in enumerate(items(path)):
        rid = f"repro-{i}-{uuid.uuid4().hex[:8]}"
        p_body = dict(body, max_tokens=1, stream=False, kv_transfer_params=dict(PREFILL_KV_PARAMS))
        t0 = time.time()
        status, text = post(p_url + "/v1/completions", p_body, rid, timeout)
        print(f"  request {i}: P answered HTTP {status} in {time.time() - t0:.2f} s")
        r = {"request": i, "id": pid, "rid": rid, "prefill_status": status, "decode_status": None, "decode_text": None}
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
                r["decode_response"] = json.loads(text)
                shown = r["decode_response"]["choices"][0]["text"]
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
        with open(answers) as f:
            results = json.load(f)
    except (OSError, ValueError):
        results = []
    served = [r for r in results if r.get("decode_status") == 200]
    if results and len(served) == len(results):
        print(
            f"NOT REPRODUCED: no line matching /{pattern}/ in {', '.join(map(os.path.basename, logs))}; "
            f"P handed over KV and D answered all {len(served)} request(s) (HTTP 200)"
        )
        return 1
    print(
        f"INCONCLUSIVE: no line matching /{pattern}/, and the requests did not get through "
        f"({len(served)} of {len(results)} answered by D); see the logs: {', '.join(logs)}"
    )
    return 3


def compare(base_path, answers_path, cls, threshold, top_k):
    """The harness's rule on the replayed requests: a token outside the other side's top-k is a mismatch; a chosen
    token's |Δlogprob| over the threshold fails logprob-mismatch (a mismatch counts for it too)."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "rule"))
    from compare import compare_one  # the harness's own rule, copied into the bundle
    from completion import parse_completion

    with open(base_path) as f:
        base = {r["id"]: r for r in json.load(f)}
    try:
        with open(answers_path) as f:
            answers = json.load(f)
    except (OSError, ValueError):
        answers = []
    got, failed = [], []
    for r in answers:
        b = base.get(r["id"])
        if r.get("decode_status") != 200 or not b or b.get("status") != 200:
            failed.append(r["id"])
            continue
        got.append(
            compare_one(
                parse_completion(r["id"], b["response"]), parse_completion(r["id"], r["decode_response"]), top_k
            )
        )
    hits = [c for c in got if c.status == "mismatch"]
    if cls == "logprob-mismatch":
        hits += [c for c in got if c.status != "mismatch" and (c.max_logprob_delta or 0) > threshold]
    for pid, b in base.items():
        ctl = control_line(b, top_k, threshold)
        print(f"  no-P/D control, {pid}: " + (ctl[1] if ctl else "not run (the plain server gave fewer than 2 tokens)"))
    if hits:
        c = hits[0]
        d = c.divergence
        at = (
            f"first divergence at token {d.position} (D {d.pd_token} vs baseline {d.baseline_token})"
            if d is not None and c.status == "mismatch"
            else "tokens equal where compared"
        )
        delta = "n/a" if c.max_logprob_delta is None else f"{c.max_logprob_delta:.3g}"
        print(
            f"REPRODUCED: prompt {c.prompt_id}, {at}, max |Δlogprob| {delta} ({len(hits)} of {len(got)} replayed "
            f"request(s) fail as {cls}; top-{top_k}, threshold {threshold:g})"
        )
        return 0
    if failed or not got:
        print(
            f"INCONCLUSIVE: {len(failed)} of {len(answers)} request(s) were not answered by both sides "
            f"({', '.join(failed) or 'none sent'}); see the logs"
        )
        return 3
    worst = max((c.max_logprob_delta or 0.0) for c in got)
    if worst > threshold:  # only for output-mismatch: the tokens agree, the logprobs do not
        print(
            f"NOT REPRODUCED: no replayed request's tokens leave the other side's top-{top_k}, but max |Δlogprob| "
            f"{worst:.3g} > {threshold:g} (that is logprob-mismatch, not {cls})"
        )
        return 1
    print(
        f"NOT REPRODUCED: all {len(got)} replayed request(s) match the plain server (top-{top_k}, max |Δlogprob| "
        f"{worst:.3g} <= {threshold:g})"
    )
    return 1


@dataclasses.dataclass
class Digested:
    """One folder of KV digest records compared by the harness's check, or why it was not."""

    marks: dict[str, str]  # a part of a request id -> the prompt id it stands for
    records: list[Any] = dataclasses.field(default_factory=list)
    skipped: str = ""
    comparison: Any = None  # kv_digest.DigestComparison
    check: Any = None  # check.Check

    def prompt(self, request_id: str) -> str | None:
        return next((p for m, p in self.marks.items() if m in request_id), None)


def digested(kv: Any, folder: str, marks: dict[str, str], why_none: str) -> Digested:
    records, unavailable = kv.load(Path(folder))
    d = Digested(marks, records)
    if unavailable:  # a rank that could not digest: skipped, never passed (the run's words)
        d.skipped = "the hook could not digest on this vLLM: " + "; ".join(unavailable)
    elif not records:
        d.skipped = why_none
    else:
        d.comparison = kv.compare(records)
        d.check = kv.check(d.comparison)
    return d


def show_digest(kv: Any, label: str, d: Digested) -> None:
    """One line as the run's kv_digest_match words it; on a mismatch, its location line with the prompt."""
    if d.check is None:
        print(f"KV digest ({label}): skipped: {d.skipped}")
        return
    print(f"KV digest ({label}): {'pass' if d.check.passed else 'FAIL'}: {d.check.detail}")
    line = kv.location_line(d.check)
    if line:
        pid = d.prompt(d.comparison.first.request_id)
        print(f"  {line}" + (f" (prompt {pid})" if pid else ""))


def differs_at(kv: Any, records: list[Any], request_ids: set[str], key: Any) -> bool | None:
    """Whether D's digest at ``key``'s layer, part, head and position (in one of ``request_ids``) differs from P's;
    None where no D record holds or needs that place."""
    import numpy as np

    for r in records:
        if r.side != "decode" or r.request_id not in request_ids:
            continue
        if key.layer not in r.layers or key.part not in r.parts or key.head not in r.heads:
            continue
        at = np.nonzero(r.positions == key.position)[0][:1]
        if not len(at):
            if r.left_out <= key.position < r.num_tokens:
                return True  # needed and not received, as the check counts it
            continue
        li, si, hi = r.layers.index(key.layer), r.parts.index(key.part), r.heads.index(key.head)
        one = dataclasses.replace(  # that one digest of D's, against all of P's for the request
            r,
            layers=(key.layer,),
            parts=(key.part,),
            heads=(key.head,),
            positions=r.positions[at],
            digest=r.digest[li : li + 1, si : si + 1, hi : hi + 1][..., at],
            num_tokens=0,
        )
        peers = [p for p in records if p.side == "prefill" and p.request_id == r.request_id]
        return bool(kv.compare([*peers, one]).differ)
    return None


def same_place(kv: Any, run: Digested, replay: Digested) -> str:
    """Whether the replay differs where the run's records first did, in words."""
    if run.check is None or replay.check is None:
        return f"not compared with the run's: the {'run' if run.check is None else 'replay'} was not digested"
    if run.check.passed:
        mine = "so do the replay's" if replay.check.passed else "the replay's do not"
        return f"the run's records of these prompts match P's; {mine}"
    k = run.comparison.first
    if k is None:
        return f"the run's records name no differing place ({run.check.detail}): not compared"
    pid = run.prompt(k.request_id)
    where = f"prompt {pid or '?'}, {k.layer} {k.part}, head {k.head}, position {k.position}"
    rids = {r.request_id for r in replay.records if pid is not None and replay.prompt(r.request_id) == pid}
    at = differs_at(kv, replay.records, rids, k)
    if at is None:
        return f"the replay holds no digest where the run first differed ({where}): not compared"
    if at:
        return f"the replay differs at the same place as the run ({where})"
    return f"the replay does not differ where the run first did ({where})" + (
        "" if replay.check.passed else "; it differs elsewhere"
    )


def digest(replay_dir, run_dir, answers_path, vllm):
    """The replay's KV digest, as the run's check words it; with the run's records (the bundle's kv_digest/), theirs
    and whether the replay differs where the run first did. Informational: repro.sh's exit code is the verdict's."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "rule"))
    try:
        import kv_digest as kv  # the harness's own check, copied into the bundle
    except ImportError as e:  # numpy is not in this interpreter
        print(f"KV digest (replay): skipped: the comparer cannot run here ({e})")
        return 0
    try:
        with open(answers_path) as f:
            answers = json.load(f)
    except (OSError, ValueError):
        answers = []
    none = (
        f"no server wrote a digest record: the hook knows no NIXL worker in vLLM {vllm} to patch"
        if any(a.get("prefill_status") == 200 for a in answers)
        else "no request was prefilled by P: nothing was digested"
    )
    replay = digested(kv, replay_dir, {a["rid"]: a["id"] for a in answers if a.get("rid")}, none)
    show_digest(kv, "replay", replay)
    if os.path.isdir(run_dir):  # the run's records of the replayed prompts: P's request id holds "-pd-<prompt id>-"
        run = digested(kv, run_dir, {f"-pd-{a['id']}-": a["id"] for a in answers}, "none of these prompts")
        show_digest(kv, "the run's records", run)
        print("KV digest: " + same_place(kv, run, replay))
    return 0


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
    b = sub.add_parser("baseline")
    b.add_argument("url")
    b.add_argument("requests")
    b.add_argument("--timeout", type=float, default=180)
    b.add_argument("--out", required=True)
    b.add_argument("--ids-out", required=True)
    c = sub.add_parser("compare")
    c.add_argument("base")
    c.add_argument("answers")
    c.add_argument("--cls", required=True)
    c.add_argument("--threshold", type=float, required=True)
    c.add_argument("--top-k", type=int, required=True)
    g = sub.add_parser("digest")
    g.add_argument("records")
    g.add_argument("--run", default="")
    g.add_argument("--answers", required=True)
    g.add_argument("--vllm", default="?")
    a = ap.parse_args(argv)
    if a.cmd == "baseline":
        return baseline(a.url, a.requests, a.timeout, a.out, a.ids_out)
    if a.cmd == "compare":
        return compare(a.base, a.answers, a.cls, a.threshold, a.top_k)
    if a.cmd == "digest":
        return digest(a.records, a.run, a.answers, a.vllm)
    if a.cmd == "ports":
        return ports(a.sizes)
    if a.cmd == "wait":
        return wait(a.url, a.pid, a.log, a.timeout, a.pattern)
    if a.cmd == "send":
        return send(a.p_url, a.d_url, a.requests, a.timeout, a.out)
    return verdict(a.pattern, a.logs, a.answers, a.wait)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
