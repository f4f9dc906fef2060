"""Whether each host of a run answers over the network, before anything is launched on it.

A host answers a TCP connection attempt on a port nothing listens on with a reset ("connection refused"): that is
an answer. No answer within the timeout (or no route) means the host is unreachable from here, which a run across
hosts must say at once instead of waiting out a server's start-up timeout."""

from __future__ import annotations

import errno
import socket
from collections.abc import Sequence

from harness.hosts.placement import Host

PROBE_TIMEOUT_S = 3.0
_NO_ROUTE = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN}


class HostUnreachable(RuntimeError):
    def __init__(self, host: Host, why: str):
        super().__init__(f"host {host.name} ({host.address}) is unreachable from the harness: {why}")
        self.host = host


def probe(address: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None if ``address`` answered on ``port`` (accepted or refused); else why not."""
    try:
        with socket.create_connection((address, port), timeout=timeout_s):
            return None
    except ConnectionRefusedError:
        return None
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except OSError as e:
        if e.errno in _NO_ROUTE:
            return e.strerror or str(e)
        raise


def check_reachable(hosts: Sequence[Host], port: int, timeout_s: float = PROBE_TIMEOUT_S) -> list[str]:
    """Probe each distinct host once (``port`` from the run's allocator); raise HostUnreachable for the first that
    does not answer. Returns the names of the hosts probed."""
    seen: dict[str, Host] = {h.name: h for h in hosts}
    for host in seen.values():
        why = probe(host.address, port, timeout_s)
        if why is not None:
            raise HostUnreachable(host, why)
    return list(seen)
