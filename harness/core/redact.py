"""Secrets kept out of everything the harness writes (docs/faults.md, "Secrets").

Reports, repro bundles, the baseline cache and the wheelhouse's manifest and logs are handed between people; the
environment, command lines and URLs they record can hold tokens and passwords. Two rules find a secret:

- a **name** (an environment variable, a command-line flag, a ``NAME=value`` word) is secret when one of its parts
  (split at ``_``, ``-``, ``.``; case ignored) is one of ``SECRET_PARTS`` or ends in one of ``SECRET_ENDINGS``; when
  its last part is ``TOKEN`` (or ends in it) unless the part before says it is a token of text (``first_token``,
  ``pd_token``: ``TEXT_TOKEN_WORDS``); when a part ``KEY`` follows one of ``KEY_OWNERS`` (``api_key``,
  ``AWS_SECRET_ACCESS_KEY``: a ``cache_key`` is a lookup key); or when its last part is ``SESSION``. So ``HF_TOKEN``,
  ``VLLM_API_KEY``, ``PGPASSWORD``, ``DB_PASSWD``, ``GCP_CREDS``, ``PROXY_AUTH``, ``--api-key``, ``--hf-token`` are
  secret, while ``TOKENIZERS_PARALLELISM``, ``prompt_token_ids``, ``first_token``, ``cache_key``,
  ``VLLM_CPU_KVCACHE_SPACE``, ``XDG_SESSION_TYPE``, ``PWD`` are not;
- a **URL's credentials**: ``scheme://user:pass@host`` (or ``scheme://token@host``) becomes ``scheme://***@host``,
  wherever the URL stands (a value, a command line, a log line).

A secret's value becomes ``MASK``; the name stays, so a reader sees that it was set.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping
from typing import Any

MASK = "***"
# A part equal to one of these makes a name secret.
SECRET_PARTS = frozenset(
    {
        "APIKEY",
        "SECRET",
        "SECRETS",
        "PASSWORD",
        "PASSWD",
        "PASSPHRASE",
        "CREDENTIAL",
        "CREDENTIALS",
        "CREDS",
        "AUTH",
        "AUTHORIZATION",
        "COOKIE",
        "COOKIES",
    }
)
# A part ending in one of these (PGPASSWORD, SMBPASSWD, CLIENTSECRET, OPENAIAPIKEY) makes a name secret.
SECRET_ENDINGS = ("SECRET", "PASSWORD", "PASSWD", "APIKEY")
# KEY after one of these is a credential; after anything else (cache_key, sort_key) a lookup key.
KEY_OWNERS = frozenset({"API", "ACCESS", "SECRET", "PRIVATE", "CLIENT", "SIGNING", "ENCRYPTION", "MASTER", "SSH"})
# TOKEN after one of these is a token of text (a token id), not a credential.
TEXT_TOKEN_WORDS = frozenset(
    {
        "FIRST",
        "LAST",
        "NEXT",
        "PD",
        "PROMPT",
        "BOS",
        "EOS",
        "PAD",
        "UNK",
        "SEP",
        "CLS",
        "MASK",
        "START",
        "END",
        "STOP",
        "INPUT",
        "OUTPUT",
        "SPECIAL",
        "SAMPLED",
        "TOP",
        "EXPECTED",
        "GOT",
        "NEW",
        "EACH",
        "PER",
    }
)

_PART_SPLIT = re.compile(r"[^A-Za-z0-9]+")
# A shell word's value: quoted pieces and bare characters, as shlex.quote and `K=V` command lines write them.
_VALUE = r"""(?:'[^']*'|"(?:[^"\\]|\\.)*"|[^\s'"]+)+"""
_URL_CREDENTIALS = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/?#\s@'\"<>]+@")
_ASSIGNMENT = re.compile(r"(?<![A-Za-z0-9_.-])([A-Za-z_][A-Za-z0-9_.-]*)=(" + _VALUE + ")")
_FLAG = re.compile(r"(?<![A-Za-z0-9_-])(--?[A-Za-z][A-Za-z0-9_.-]*)(=|\s+(?![-\s#]))(" + _VALUE + ")")
# 'api_key': 'x' / "HF_TOKEN": "x": a Python dict's repr or JSON in a log line.
_QUOTED_ITEM = re.compile(r"""(['"])([A-Za-z_][A-Za-z0-9_.-]*)\1(\s*:\s*)(['"])((?:(?!\4)[^\\]|\\.)*)\4""")
_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")


def is_secret_name(name: str) -> bool:
    """Whether a variable, flag or key of this name holds a secret (the module's rule)."""
    parts = [p for p in _PART_SPLIT.split(name.upper()) if p]
    if not parts:
        return False
    if any(p in SECRET_PARTS or p.endswith(SECRET_ENDINGS) for p in parts):
        return True
    if any(p == "KEY" and before in KEY_OWNERS for before, p in itertools.pairwise(parts)):
        return True
    last, before = parts[-1], parts[-2] if len(parts) > 1 else ""
    if last.endswith("TOKEN") and not (last == "TOKEN" and before in TEXT_TOKEN_WORDS):
        return True
    return last == "SESSION" and len(parts) > 1


def redact_text(text: str) -> str:
    """``text`` (a value, a command line, a log) with URL credentials, ``NAME=value`` and ``--flag value`` of secret
    names, and ``'name': 'value'`` items of secret names masked."""
    text = _URL_CREDENTIALS.sub(lambda m: m.group(1) + MASK + "@", text)
    text = _ASSIGNMENT.sub(lambda m: f"{m.group(1)}={MASK}" if is_secret_name(m.group(1)) else m.group(0), text)
    text = _FLAG.sub(lambda m: m.group(1) + m.group(2) + MASK if is_secret_name(m.group(1)) else m.group(0), text)
    return _QUOTED_ITEM.sub(
        lambda m: (
            f"{m.group(1)}{m.group(2)}{m.group(1)}{m.group(3)}{m.group(4)}{MASK}{m.group(4)}"
            if is_secret_name(m.group(2))
            else m.group(0)
        ),
        text,
    )


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """An environment with each secret variable's value masked and credentials taken out of every other value."""
    return {k: MASK if is_secret_name(k) else redact_text(str(v)) for k, v in env.items()}


def redact_argv(argv: Iterable[str]) -> list[str]:
    """A command as words: the value after a secret flag (``--api-key X``, ``--api-key=X``), a secret ``NAME=value``
    word, and URL credentials in any word masked."""
    out: list[str] = []
    secret_next = False
    for word in map(str, argv):
        if secret_next and not word.startswith("-"):
            out.append(MASK)
        else:
            out.append(redact_text(word))
        secret_next = word.startswith("-") and "=" not in word and is_secret_name(word)
    return out


def redact_tree(obj: Any) -> Any:
    """A JSON-like value (a report, a manifest) with every string redacted (``redact_text``), and the value of each
    key that reads as a secret environment variable (upper case: ``HF_TOKEN``) masked. Lower-case keys are field
    names of the harness's own (``key``: a cache key, ``pd_token``: a token id), never taken for secrets."""
    if isinstance(obj, str):
        return redact_text(obj)
    if isinstance(obj, Mapping):
        return {
            k: MASK
            if isinstance(k, str) and isinstance(v, str) and _ENV_NAME.fullmatch(k) and is_secret_name(k)
            else redact_tree(v)
            for k, v in obj.items()
        }
    if isinstance(obj, list | tuple):
        return [redact_tree(v) for v in obj]
    return obj
