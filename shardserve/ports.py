"""Free TCP ports, picked by the OS at run time (servers, routers and rendezvous addresses of
spawned ranks never use a fixed port)."""
from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (picked by the OS)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
