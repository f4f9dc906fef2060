"""python -m harness: the e2e run, topology and model commands here; the others in their packages
(SUBCOMMAND_MODULES)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from harness.core.argtypes import HarnessArgumentParser, positive_int
from harness.core.errors import ConfigError
from harness.core.files import claim_run_dir
from harness.core.interrupts import catch_interrupts
from harness.e2e.args import PROG, add_e2e_parser, config_from_args
from harness.gpu.detect import default_device
from harness.run.config import E2EConfig, env_defaults

# The e2e flags and config_from_args live in harness/e2e/args.py (a package the nightly may import); imported here,
# `from harness.cli import config_from_args` keeps working.

# Subcommands that live in their own modules; each has add_parser(subparsers) and main(args) -> exit code.
SUBCOMMAND_MODULES = {
    "plan": "harness.gpu.cli",
    "bench": "harness.bench.cli",
    "nightly": "harness.nightly.cli",
    "matrix": "harness.matrix.cli",
    "envs": "harness.envs.envs_cli",
    "bisect": "harness.releases.bisect_cli",
    "history": "harness.releases.history_cli",
    "repro": "harness.repro.cli",
    "shrink": "harness.shrink.cli",
    "wheelhouse": "harness.wheelhouse.cli",
    "calibrate": "harness.calibrate.cli",
    "doctor": "harness.doctor.cli",
    "explore": "harness.explore.cli",
}


def _subcommand(name: str):
    import importlib

    return importlib.import_module(SUBCOMMAND_MODULES[name])


def build_parser() -> argparse.ArgumentParser:
    ap = HarnessArgumentParser(prog=PROG, description="vLLM P/D (NixlConnector) heterogeneous-TP accuracy harness")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_e2e_parser(sub)

    tp = sub.add_parser("topology", help="predict heads per rank, regime and handshake outcome for a TP pair")
    src = tp.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="local model folder, hub id or id in configs/models.yaml")
    src.add_argument("--kv-heads", type=positive_int, help="K (num_key_value_heads); needs --heads")
    tp.add_argument("--heads", type=positive_int, help="attention heads (with --kv-heads)")
    tp.add_argument("--head-dim", type=positive_int, default=64)
    tp.add_argument("--dtype", default="bfloat16")
    tp.add_argument("--tp-p", type=positive_int, required=True)
    tp.add_argument("--tp-d", type=positive_int, required=True)
    tp.add_argument("--block-size-p", type=positive_int, default=16)
    tp.add_argument("--block-size-d", type=positive_int)
    tp.add_argument("--pp-p", type=positive_int, default=1, help="P's pipeline-parallel stages")
    tp.add_argument("--dcp-d", type=positive_int, default=1, help="D's decode context parallel size")
    tp.add_argument("--vllm-version", help="e.g. 0.21.0 (default: a fixed version)")
    tp.add_argument("--json", action="store_true")

    m = sub.add_parser("model", help="build local models")
    msub = m.add_subparsers(dest="model_cmd", required=True)
    t = msub.add_parser(
        "tiny", help="a deterministic random-weights Llama (or --family) with a locally trained tokenizer"
    )
    t.add_argument(
        "--family",
        default="llama",
        help=(
            "llama (default), qwen3, qwen2, mistral, gemma3, deepseek_v2 (MLA), qwen3_moe (routed experts), "
            "mimo (a Qwen2 with an MTP layer), granitemoehybrid (Mamba2 + attention)"
        ),
    )
    t.add_argument("--sliding-window", type=positive_int, help="tokens (mistral, gemma3; default 64)")
    t.add_argument("--kv-heads", type=positive_int, default=1, help="K (deepseek_v2: must equal --heads)")
    t.add_argument("--heads", type=positive_int, default=4)
    t.add_argument("--layers", type=positive_int, default=2)
    t.add_argument("--head-dim", type=positive_int, default=64)
    t.add_argument("--out", type=Path, help="copy the model here (it is always cached under .cache/models)")
    for name in SUBCOMMAND_MODULES:
        _subcommand(name).add_parser(sub)
    return ap


def default_model_note(cfg: E2EConfig) -> str:
    """The line that says a GPU run without --model serves the reported case's model, and its regime."""
    from harness.run.preflight import preflight_config

    topo = preflight_config(cfg).topology
    shape = f" (K={topo.kv_heads}: P{cfg.tp_p}->D{cfg.tp_d} is regime {topo.regime})" if topo else ""
    return (
        f"model: no --model given, so the GPU run serves {cfg.model}, the model of vLLM issue #45330{shape}; "
        "it must be in the Hugging Face cache (servers run with HF_HUB_OFFLINE=1)"
    )


def attach_from_args(a: argparse.Namespace):
    """The Attach spec when --prefill-url/--decode-url are given, else None."""
    if not (a.prefill_url or a.decode_url or a.baseline_url):
        if getattr(a, "attached_kv_digest", None) is not None:
            raise ConfigError("--attached-kv-digest is for attach mode (--prefill-url/--decode-url)")
        return None
    from harness.serve.servers import Attach

    def urls(raw: str | None, flag: str) -> tuple[str, ...]:
        out = tuple(u.strip() for u in (raw or "").split(",") if u.strip())
        if not out:
            raise ConfigError(f"attach mode needs {flag}")
        bad = [u for u in out if not u.startswith(("http://", "https://"))]
        if bad:
            raise ConfigError(f"{flag}: not an http(s) URL: {bad[0]}")
        return out

    baseline = urls(a.baseline_url, "--baseline-url")[0] if a.baseline_url else None
    digest_dir = getattr(a, "attached_kv_digest", None)
    # the hook makes its folder with its first record: a folder not there yet is fine, a file is not
    if digest_dir is not None and Path(digest_dir).exists() and not Path(digest_dir).is_dir():
        raise ConfigError(f"--attached-kv-digest: not a folder: {digest_dir}")
    return Attach(
        urls(a.prefill_url, "--prefill-url"),
        urls(a.decode_url, "--decode-url"),
        baseline,
        digest_dir=str(Path(digest_dir).resolve()) if digest_dir is not None else None,
    )


def attach_config(a: argparse.Namespace, attach, env=None):
    """Attach mode: (config, attach) from the flags and what the attached servers said (``attach.served``, from
    ``read_attached``): the model D serves unless --model, the device, dtype and max_model_len as they serve them
    (``attach_settings``); a baseline launched here that this machine cannot run is refused. ConfigError."""
    import os
    from dataclasses import replace

    from harness.run.config import UPSTREAM_ENV, attach_settings

    defaults = env_defaults(os.environ if env is None else env)
    given: dict[str, tuple[int, str]] = {}  # the TP sizes the user gave, with the flag or variable that gave each
    for name, flag in (("tp_p", "--tp-p"), ("tp_d", "--tp-d")):
        if getattr(a, name) is not None:
            given[name] = (getattr(a, name), flag)
        elif name in defaults:
            given[name] = (int(str(defaults[name])), f"${UPSTREAM_ENV[name]}")
    # this host's default device counts only where every attached server runs on this host (attach_settings)
    settings = attach_settings(attach, a.model, a.device, a.dtype, a.max_model_len, default_device, given)
    return config_from_args(a, env, preflight=True, attached=settings), replace(attach, sources=settings.sources)


def topology_main(a: argparse.Namespace) -> int:
    import json

    from harness.envs.vllm_env import check_version
    from harness.models.heads import model_heads
    from harness.models.topology import ModelShape, predict, shape_problem

    if a.vllm_version is not None:
        try:
            check_version(a.vllm_version)  # as e2e checks it: an unknown word would pass as the fixed family
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if a.model is not None:
        try:
            heads = model_heads(a.model)
        except ConfigError as e:  # configs/models.yaml is broken: one line, as matrix and plan say it
            print(f"error: {e}", file=sys.stderr)
            return 2
        if heads["kv_heads"] is None:
            print(
                f"error: unknown model {a.model!r}: give a local folder with config.json, an entry of "
                "configs/models.yaml, or --kv-heads K --heads H",
                file=sys.stderr,
            )
            return 2
        # MLA: one latent head per rank, as wide as the model's latent (heads.py), whatever --head-dim says.
        mla = bool(heads.get("mla"))
        head_dim = int(heads["head_dim"]) if mla and heads["head_dim"] else a.head_dim
        shape = ModelShape(int(heads["attention_heads"] or 0), int(heads["kv_heads"]), head_dim, a.dtype, mla)
    else:
        if a.heads is None:
            print("error: --kv-heads needs --heads", file=sys.stderr)
            return 2
        shape = ModelShape(a.heads, a.kv_heads, a.head_dim, a.dtype)
    problem = shape_problem(shape)
    if problem:
        print(f"error: {problem}: not a model vLLM loads", file=sys.stderr)
        return 2
    t = predict(shape, a.tp_p, a.tp_d, a.block_size_p, a.block_size_d, a.vllm_version, pp_p=a.pp_p, dcp_d=a.dcp_d)
    if a.json:
        print(json.dumps(t.to_dict(), indent=2))
    else:
        print(f"P TP{t.tp_p} -> D TP{t.tp_d}, K={t.kv_heads}: regime {t.regime} ({t.regime_description})")
        print(
            f"  heads per rank: P {t.p_heads_per_rank}, D {t.d_heads_per_rank}; tp_ratio {t.tp_ratio}; "
            f"block length P {t.p_block_len} B, D {t.d_block_len} B"
        )
        if t.pp_p > 1 or t.dcp_d > 1:
            print(f"  P pipeline stages {t.pp_p}, D decode context parallel {t.dcp_d}")
        if t.d_sources:
            reads = "; ".join(
                f"D{r} <- " + ", ".join(f"P stage {s} rank {p}" for s, p in src) for r, src in enumerate(t.d_sources)
            )
            print(f"  reads: {reads}")
        print(
            f"  expected on vLLM {t.vllm_version or '(fixed)'} [{t.version_family}]: {t.expected} - {t.expected_reason}"
        )
    return 0


def _interrupted_before_run(e: KeyboardInterrupt) -> int:
    signum = getattr(e, "signum", signal.SIGINT)
    print(f"interrupted by {signal.Signals(signum).name} before the run started: nothing ran", file=sys.stderr)
    return 128 + signum


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    from harness.core import progress

    progress.use(progress.on_stderr())  # progress goes to stderr only: stdout stays what scripts parse
    if a.cmd == "matrix" and a.ray:  # entries as Ray tasks: harness/cluster, above matrix (docs/architecture.md)
        from harness.cluster.cli import main as ray_matrix

        return ray_matrix(a)
    if a.cmd in SUBCOMMAND_MODULES:
        return _subcommand(a.cmd).main(a)
    if a.cmd == "topology":
        return topology_main(a)
    if a.cmd == "model":
        from harness.models.tiny import TinyModelSpec, ensure_tiny_model, export

        try:
            spec = TinyModelSpec(
                kv_heads=a.kv_heads,
                heads=a.heads,
                layers=a.layers,
                head_dim=a.head_dim,
                family=a.family,
                sliding_window=a.sliding_window,
            )
            path = export(spec, a.out) if a.out else ensure_tiny_model(spec)
        except (ValueError, FileExistsError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(path)
        return 0
    try:
        attach = attach_from_args(a)
        if attach is None:
            cfg = config_from_args(a, preflight=True)
        else:  # the servers run with their own TP sizes; the run takes device, dtype and lengths from them
            from harness.serve.servers import read_attached

            cfg, attach = attach_config(a, read_attached(attach))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if attach is None and a.model is None and cfg.device == "gpu":
        print(default_model_note(cfg), flush=True)
    from harness.run.pipeline import PDRun
    from harness.run.report import print_summary

    catch_interrupts()
    try:  # an interrupt before the run's own handling: one line, and nothing started (the folder is made by run())
        if cfg.run_dir is not None and a.overwrite_run_dir:
            claim_run_dir(Path(cfg.run_dir), overwrite=True)
        run = PDRun(cfg, attach=attach)
        print(f"run folder: {run.run_dir}", flush=True)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        return _interrupted_before_run(e)
    try:
        d = run.run()
    except KeyboardInterrupt as e:
        report = run.run_dir / "report.json"
        if not report.exists():  # the signal came before the run's try: nothing was started
            return _interrupted_before_run(e)
        print_summary(json.loads(report.read_text()), run.run_dir)
        return 128 + getattr(e, "signum", signal.SIGINT)
    print_summary(d, run.run_dir)
    return 0 if d["verdict"] == "pass" else 1
