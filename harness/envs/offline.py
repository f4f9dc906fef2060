"""An offline install: ``.venv`` installed from a wheelhouse (``make setup WHEELHOUSE=DIR``, docs/offline-install.md).

scripts/setup.sh stamps such a ``.venv`` ``wheelhouse <device> <folder> <hash>``; the folder's ``manifest.json``
names the vLLM release it holds, which is what ``.venv`` serves (the newest the image's torch allows, not always the
pinned one). Every other version installs from a package index, which an air-gapped node does not have: such a
version is refused in one line before anything starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from harness.core import safe
from harness.core.errors import ConfigError
from harness.core.paths import REPO_ROOT

STAMP_PREFIX = "wheelhouse "  # scripts/setup.sh's stamp of an install from a wheelhouse


@dataclass(frozen=True)
class OfflineInstall:
    wheelhouse: str  # the folder .venv was installed from
    vllm: str | None  # the vLLM release its manifest names; None: the manifest cannot be read (the folder is gone)

    def refusal(self, version: str) -> str | None:
        """Why vLLM ``version`` cannot serve here (one line), or None when it is the one .venv holds."""
        if version == self.vllm:
            return None
        held = f"which holds vLLM {self.vllm}" if self.vllm else "whose manifest.json cannot be read"
        return (
            f"vLLM {version} cannot be installed here: .venv was installed offline from the wheelhouse "
            f"{self.wheelhouse}, {held}, and other versions install from a package index; leave VLLM_VERSION and "
            f"--vllm-version unset (or build a wheelhouse with --vllm {version}, docs/offline-install.md)"
        )


def offline_install(root: Path = REPO_ROOT) -> OfflineInstall | None:
    """The wheelhouse ``root``'s .venv was installed from, and the vLLM it holds; None for an install from an index."""
    try:
        stamp = (root / ".venv" / ".setup-stamp").read_text().strip()
    except OSError:
        return None
    if not stamp.startswith(STAMP_PREFIX):
        return None
    # "<device> <folder> <hash>": the folder may hold spaces, the device and the hash never do
    parts = stamp[len(STAMP_PREFIX) :].split(" ", 1)
    folder = parts[-1].rsplit(" ", 1)[0]
    try:
        vllm = json.loads((Path(folder) / "manifest.json").read_text())["vllm"]["version"]
        return OfflineInstall(folder, safe.version(vllm, "the wheelhouse's vllm version"))
    except (OSError, ValueError, KeyError, TypeError, ConfigError):
        return OfflineInstall(folder, None)
