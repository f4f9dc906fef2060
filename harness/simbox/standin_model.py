"""What a stand-in server answers (pure): a deterministic "model" and the OpenAI-style bodies vLLM sends.

The stand-in (standin.py) serves a simulated GPU box in place of vLLM. Its answers are a function of the prompt's
token ids only, so a baseline and a P/D pair of stand-ins agree exactly, whatever the TP sizes: that proves the
harness's plumbing (proxy, request ids, token-id prompts, logprobs parsing), never vLLM's numerics. It exports
no NIXL counter and logs no transfer line: a check of the data path that was not skipped would fail, never pass.

Tokens: one per whitespace-separated word (a hash of the word), after a BOS, as ``token_id:N`` when the client asks
for ids (``return_tokens_as_token_ids``). Each generated token is a hash of the sequence so far; the top-k logprobs
put it first. No EOS: every answer runs to max_tokens (finish_reason "length").
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

VOCAB = 32000
BOS = 1
FIRST_WORD_ID = 100  # ids below this are "special"
# What this stand-in exports on /metrics: the gauges harness/checks/leak.py reads to see the server idle.
METRIC_LABELS = 'engine="0",model_name="{name}"'


def word_id(word: str) -> int:
    h = hashlib.blake2b(word.encode(), digest_size=4).digest()
    return FIRST_WORD_ID + int.from_bytes(h, "big") % (VOCAB - FIRST_WORD_ID)


def tokenize(text: str, add_bos: bool = True) -> list[int]:
    return ([BOS] if add_bos else []) + [word_id(w) for w in text.split()]


def prompt_ids(prompt: str | Sequence[int]) -> list[int]:
    """A completion's prompt as ids: text is tokenized (BOS first), a list of ids is taken as it is."""
    if isinstance(prompt, str):
        return tokenize(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):  # a batch of one
        prompt = prompt[0]
    return [int(t) for t in prompt]


def next_candidates(ids: Sequence[int], k: int) -> list[tuple[int, float]]:
    """The top ``k`` next tokens after ``ids`` with their logprobs, best first (a hash of the whole sequence)."""
    h = hashlib.blake2b(struct.pack(f"<{len(ids)}I", *ids), digest_size=32).digest()
    out: list[tuple[int, float]] = []
    best = -0.05 - h[0] / 2560  # the chosen token's logprob: in (-0.15, -0.05]
    for j in range(max(1, k)):
        raw = int.from_bytes(h[4 * (j % 7) : 4 * (j % 7) + 4], "little") + 104729 * j
        tok = FIRST_WORD_ID + raw % (VOCAB - FIRST_WORD_ID)
        while any(tok == t for t, _ in out):
            tok = FIRST_WORD_ID + (tok + 7919) % (VOCAB - FIRST_WORD_ID)
        out.append((tok, best - 1.5 * j))
    return out


@dataclass(frozen=True)
class Step:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def generate(ids: Sequence[int], max_tokens: int, top_k: int) -> list[Step]:
    seq = list(ids)
    steps = []
    for _ in range(max_tokens):
        top = next_candidates(seq, top_k)
        steps.append(Step(top[0][0], top[0][1], tuple(top)))
        seq.append(top[0][0])
    return steps


def token_text(token: int) -> str:
    return f" w{token}"


@dataclass
class Request:
    """One /v1/completions body, as far as the stand-in reads it."""

    ids: list[int]
    max_tokens: int
    top_k: int | None  # logprobs=k; None: not asked
    as_ids: bool  # return_tokens_as_token_ids
    stream: bool = False
    include_usage: bool = False
    kv_transfer_params: dict | None = None
    model: str = ""
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_body(cls, body: dict) -> Request:
        lp = body.get("logprobs")
        return cls(
            prompt_ids(body["prompt"]),
            int(body.get("max_tokens") or 16),
            None if lp is None else int(lp),
            bool(body.get("return_tokens_as_token_ids")),
            bool(body.get("stream")),
            bool((body.get("stream_options") or {}).get("include_usage")),
            body.get("kv_transfer_params"),
            str(body.get("model") or ""),
        )


def _name(token: int, as_ids: bool) -> str:
    return f"token_id:{token}" if as_ids else token_text(token)


def logprobs_block(steps: Sequence[Step], req: Request, offset: int = 0) -> dict | None:
    if req.top_k is None:
        return None
    return {
        "tokens": [_name(s.token, req.as_ids) for s in steps],
        "token_logprobs": [s.logprob for s in steps],
        "top_logprobs": [{_name(t, req.as_ids): lp for t, lp in s.top[: max(1, req.top_k)]} for s in steps],
        "text_offset": list(range(offset, offset + len(steps))),
    }


def usage(req: Request, n: int) -> dict:
    return {"prompt_tokens": len(req.ids), "completion_tokens": n, "total_tokens": len(req.ids) + n}


def completion_body(rid: str, served: str, req: Request, steps: Sequence[Step], kv_params: dict | None) -> dict:
    """A non-streamed answer, as vLLM's OpenAI server shapes it (kv_transfer_params at the top level)."""
    return {
        "id": f"cmpl-{rid}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": served,
        "choices": [
            {
                "index": 0,
                "text": "".join(token_text(s.token) for s in steps),
                "logprobs": logprobs_block(steps, req),
                "finish_reason": "length",
                "stop_reason": None,
            }
        ],
        "usage": usage(req, len(steps)),
        "kv_transfer_params": kv_params,
    }


def stream_chunks(rid: str, served: str, req: Request, steps: Sequence[Step]) -> list[dict]:
    """The streamed answer's chunks (one per token, then the usage when asked); ``data: [DONE]`` is the caller's."""
    base = {"id": f"cmpl-{rid}", "object": "text_completion", "created": int(time.time()), "model": served}
    out = []
    for i, s in enumerate(steps):
        last = i == len(steps) - 1
        choice = {
            "index": 0,
            "text": token_text(s.token),
            "logprobs": logprobs_block([s], req, i),
            "finish_reason": "length" if last else None,
            "stop_reason": None,
        }
        out.append({**base, "choices": [choice]})
    if req.include_usage:
        out.append({**base, "choices": [], "usage": usage(req, len(steps))})
    return out


def prefill_params(req: Request, engine_id: str, block_size: int, host: str, port: int, tp: int) -> dict | None:
    """What P hands the proxy for D when asked to (do_remote_decode), shaped as vLLM's NixlConnector's; nothing
    is transferred: the block ids name no memory."""
    asked = req.kv_transfer_params or {}
    if not asked.get("do_remote_decode"):
        return None
    blocks = -(-len(req.ids) // block_size)
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": list(range(blocks)),
        "remote_engine_id": engine_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": tp,
    }


def metrics_text(
    served: str, running: int, blocks: int, block_size: int, counters: dict[str, float], simulated: str
) -> str:
    """The Prometheus text of /metrics: idle gauges (leak.py), the pool (cache_config_info), request counters."""
    lab = METRIC_LABELS.format(name=served)
    lines = [
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{lab}}} {float(running)}",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{lab}}} 0.0",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{lab}}} 0.0",
        "# TYPE vllm:cache_config_info gauge",
        f'vllm:cache_config_info{{block_size="{block_size}",engine="0",num_gpu_blocks="{blocks}"}} 1.0',
    ]
    for name, value in sorted(counters.items()):
        lines += [f"# TYPE {name} counter", f"{name}{{{lab}}} {float(value)}"]
    lines += ["# TYPE pd_harness:standin_info gauge", f'pd_harness:standin_info{{simulated="{simulated}"}} 1.0']
    return "\n".join(lines) + "\n"
