"""Free TCP ports, picked at run time (servers, routers and rendezvous addresses of spawned ranks
never use a fixed port)."""
from __future__ import annotations

import random
import socket
from pathlib import Path

_LOWEST = 10000  # below: ports people give services by hand


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now and outside the kernel's ephemeral range. A port
    from that range (what binding port 0 returns) can be handed to the next outgoing connection,
    e.g. one of the gloo connections between a replica's ranks, before the server that was meant
    to get it binds it; ports outside the range are only ever taken by a bind."""
    low, high = _ephemeral_range()
    pick = random.Random()
    for _ in range(200):
        port = pick.randrange(_LOWEST, 65536)
        if not low <= port <= high and _bindable(port):
            return port
    with socket.socket() as s:  # no port left outside the range: let the OS pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
