"""Free TCP ports for the servers this project starts (a torch.distributed store, a weight-sync group, a Ray head).

Asking the kernel for port 0 returns a port of the ephemeral range, the range every outgoing connection also takes
its local port from. Between picking such a port and the server listening on it, any connection of the machine (Ray
opens many) can take it, and the server then fails with EADDRINUSE. Ports are therefore picked at random below the
ephemeral range, where the kernel never hands out local ports, and checked free by binding them; a port handed out
by this process is not handed out again by it. Only when no such range exists is the kernel's pick used.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Below it: well-known and registered service ports, and Ray's worker ports (10000-19999 by default), which Ray's
# workers take as they start.
LOWEST = 20000
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DEFAULT_EPHEMERAL = (32768, 60999)  # Linux's default (macOS and Windows use 49152-65535, above this one)
_given: set[int] = set()
# Not the ``random`` module's generator: jobs seed it, and two workers seeded alike would pick the same ports.
_random = random.SystemRandom()


def ephemeral_range(path: Path = _RANGE_FILE) -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections (``low, high``), Linux's default when unknown."""
    try:
        low, high = (int(x) for x in path.read_text().split())
        return low, high
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "", attempts: int = 200, ephemeral: tuple[int, int] | None = None) -> int:
    """A port that ``host`` (all addresses by default) can listen on now, outside the ephemeral range."""
    low, high = ephemeral or ephemeral_range()
    candidates = [*range(LOWEST, min(low, 65536)), *range(max(high + 1, LOWEST), 65536)]
    for _ in range(attempts if candidates else 0):
        port = _random.choice(candidates)
        if port not in _given and _bindable(host, port):
            _given.add(port)
            return port
    with socket.socket() as s:  # no room outside the ephemeral range (or all of it taken): the kernel's pick
        s.bind((host, 0))
        return s.getsockname()[1]
