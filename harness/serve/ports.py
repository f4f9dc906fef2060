"""The one port allocator of the harness.

Every port a run uses (HTTP ports, NIXL side-channel ports, the ports vLLM
opens internally for torch.distributed and ZMQ) comes from here. A port is
reserved by holding an exclusive ``flock`` on a per-port lock file in a
machine-wide directory, so two harness runs at once never hand out the same
port, and a crashed run releases its ports when the kernel closes its files.
"""

from __future__ import annotations

import fcntl
import os
import random
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

# Below Linux's default ephemeral range (32768-60999), so outgoing
# connections of other programs do not grab ports we are about to hand out.
DEFAULT_RANGE = (20000, 32000)


class PortExhausted(RuntimeError):
    pass


def default_lock_dir() -> Path:
    return Path(os.environ.get("PD_HARNESS_PORT_LOCK_DIR", Path(tempfile.gettempdir()) / "vllm-pd-harness-ports"))


def _bindable(port: int) -> bool:
    # vLLM binds some ports on "" (all interfaces), so check both.
    for host in ("127.0.0.1", ""):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


@dataclass(frozen=True)
class PortBlock:
    """A contiguous run of reserved ports: ``base`` .. ``base + count - 1``."""

    base: int
    count: int

    @property
    def ports(self) -> range:
        return range(self.base, self.base + self.count)


class Ports(Protocol):
    """What hands out ports: a PortAllocator, or a stand-in that reserves nothing (a dry run's)."""

    def port(self) -> int: ...
    def block(self, count: int) -> PortBlock: ...


class PortAllocator:
    """Reserves ports for the lifetime of this object (or until ``release``)."""

    def __init__(
        self, lock_dir: Path | None = None, port_range: tuple[int, int] = DEFAULT_RANGE, seed: int | None = None
    ):
        self.lock_dir = Path(lock_dir) if lock_dir else default_lock_dir()
        self.lock_dir.mkdir(parents=True, exist_ok=True)
        self.low, self.high = port_range
        if not (1024 <= self.low < self.high <= 65535):
            raise ValueError(f"bad port range {port_range}")
        self._held: dict[int, int] = {}  # port -> fd of its lock file
        self._rng = random.Random(seed)

    def _lock(self, port: int) -> bool:
        fd = os.open(self.lock_dir / f"{port}.lock", os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._held[port] = fd
        return True

    def _unlock(self, port: int) -> None:
        fd = self._held.pop(port, None)
        if fd is not None:
            os.close(fd)  # closing drops the flock

    def block(self, count: int, attempts: int = 500) -> PortBlock:
        """Reserve ``count`` consecutive free ports."""
        if count < 1:
            raise ValueError("count must be >= 1")
        for _ in range(attempts):
            base = self._rng.randrange(self.low, self.high - count + 1)
            got: list[int] = []
            for port in range(base, base + count):
                if port in self._held or not self._lock(port):
                    break
                got.append(port)
                if not _bindable(port):
                    break
            else:
                return PortBlock(base, count)
            for port in got:
                self._unlock(port)
        raise PortExhausted(f"no {count} consecutive free ports in {self.low}-{self.high} after {attempts} tries")

    def port(self) -> int:
        return self.block(1).base

    def release(self, block: PortBlock | int) -> None:
        ports = [block] if isinstance(block, int) else list(block.ports)
        for port in ports:
            self._unlock(port)

    @property
    def held(self) -> frozenset[int]:
        return frozenset(self._held)

    def close(self) -> None:
        for port in list(self._held):
            self._unlock(port)

    def __enter__(self) -> PortAllocator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class ServerPorts:
    """The ports one vLLM server needs."""

    http: int
    side_channel_base: int  # NIXL side channel; room for one port per TP rank
    internal_base: int  # VLLM_PORT: vLLM scans upward from here for its own ports
    internal_count: int

    def to_dict(self) -> dict[str, int]:
        return {
            "http": self.http,
            "side_channel_base": self.side_channel_base,
            "internal_base": self.internal_base,
            "internal_count": self.internal_count,
        }


# vLLM opens a handful of internal ports per engine (torch.distributed store,
# ZMQ sockets); a TP-sized margin on top keeps its upward scan inside the block.
INTERNAL_PORTS_BASE = 12


def server_ports(alloc: Ports, tp: int) -> ServerPorts:
    if tp < 1:
        raise ValueError("tp must be >= 1")
    internal = INTERNAL_PORTS_BASE + 4 * tp
    return ServerPorts(
        http=alloc.port(),
        side_channel_base=alloc.block(tp).base,
        internal_base=alloc.block(internal).base,
        internal_count=internal,
    )
