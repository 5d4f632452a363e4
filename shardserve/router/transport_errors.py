"""What the HTTP client can raise when a replica dies under a request: a failure of that replica,
never the router's own error (a 500 to the client)."""
from __future__ import annotations

import httpx

# httpx's errors, and two that escape them: OSError from a socket the kernel already reset, and
# AttributeError from httpcore over anyio when the peer closed a connection while it was being
# set up (anyio's closed socket has no address to look up), seen when a replica was SIGKILLed
# with requests on the way to it
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (httpx.HTTPError, OSError, AttributeError)
