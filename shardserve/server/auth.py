"""API keys: who may call a replica, a router or a cluster (one rule for all three).

    no key configured          everything is open (a development server on loopback)
    --api-key K                every route needs `Authorization: Bearer K`; /admin/* is closed
    --admin-key A              /admin/* needs A (which also opens every other route)
    --open-probes              /health and /metrics answer without a key (load balancers, Prometheus)

Keys come from the flags, from `--api-key-file` / `--admin-key-file` (one key per line), or from
SHARDSERVE_API_KEY / SHARDSERVE_ADMIN_KEY, which is also how a cluster hands its keys to the
replicas it starts. A refusal is a 401 in OpenAI's error shape and happens before the request's
body is read: nothing is generated or changed. Keys are compared in constant time, against every
configured key, so neither a key's prefix nor its position in the list shows in the timing.
The TLS flags (`--ssl-keyfile`, `--ssl-certfile`: uvicorn serves HTTPS) are here too, so that the
keys need not cross a network in clear text.
"""
from __future__ import annotations

import hmac
import json
import os
from dataclasses import dataclass
from pathlib import Path

from shardserve.config import ConfigError

API_KEY_ENV, ADMIN_KEY_ENV = "SHARDSERVE_API_KEY", "SHARDSERVE_ADMIN_KEY"
PROBE_PATHS = ("/health", "/metrics")
ADMIN_PREFIX = "/admin"


@dataclass(frozen=True)
class AuthConfig:
    api_keys: tuple[str, ...] = ()
    admin_keys: tuple[str, ...] = ()
    open_probes: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.api_keys or self.admin_keys)

    def bearer_header(self) -> dict[str, str]:
        """What this process sends to the replicas behind it: its own API key, if it has one."""
        keys = self.api_keys or self.admin_keys
        return {"Authorization": f"Bearer {keys[0]}"} if keys else {}

    def child_env(self) -> dict[str, str]:
        """Environment for the replicas a cluster starts: the same keys, so the router's key opens them."""
        env = {}
        if self.api_keys:
            env[API_KEY_ENV] = self.api_keys[0]
        if self.admin_keys:
            env[ADMIN_KEY_ENV] = self.admin_keys[0]
        return env

    def refusal(self, path: str, key: str | None) -> str | None:
        """Why a request for `path` with bearer `key` is refused, or None when it may pass."""
        if not self.enabled:
            return None
        is_admin = _matches(key, self.admin_keys)
        if path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/"):
            if is_admin:
                return None
            if not self.admin_keys:
                return "admin routes are closed: start this server with --admin-key"
            return "admin routes need the admin key" if key else "missing API key (Authorization: Bearer <admin key>)"
        if self.open_probes and path in PROBE_PATHS:
            return None
        if is_admin or _matches(key, self.api_keys):
            return None
        return "invalid API key" if key else "missing API key (Authorization: Bearer <key>)"


def _matches(key: str | None, keys: tuple[str, ...]) -> bool:
    if key is None:
        return False
    found = False
    for known in keys:  # no early exit: every key is compared
        found |= hmac.compare_digest(key.encode(), known.encode())
    return found


def auth_config(api_keys: list[str] | None = None, api_key_file: str | None = None,
                admin_keys: list[str] | None = None, admin_key_file: str | None = None,
                open_probes: bool = False) -> AuthConfig:
    """The keys from flags, files and the environment (all of them count)."""
    return AuthConfig(api_keys=_keys(api_keys, api_key_file, API_KEY_ENV),
                      admin_keys=_keys(admin_keys, admin_key_file, ADMIN_KEY_ENV), open_probes=open_probes)


def _keys(given: list[str] | None, file: str | None, env_var: str) -> tuple[str, ...]:
    keys = list(given or [])
    if file:
        try:
            keys += [line.strip() for line in Path(file).read_text().splitlines()]
        except OSError as exc:
            raise ConfigError(f"cannot read key file {file}: {exc.strerror}") from None
    if os.environ.get(env_var):
        keys.append(os.environ[env_var])
    keys = [k for k in keys if k and not k.startswith("#")]
    if any(len(k) < 8 for k in keys):
        raise ConfigError("an API key must have at least 8 characters")
    return tuple(dict.fromkeys(keys))


def add_auth_args(parser) -> None:
    group = parser.add_argument_group("authentication (see shardserve/server/auth.py)")
    group.add_argument("--api-key", action="append", default=None, metavar="KEY",
                       help=f"a key clients must send as 'Authorization: Bearer KEY' (repeat; or ${API_KEY_ENV})")
    group.add_argument("--api-key-file", default=None, help="a file of API keys, one per line")
    group.add_argument("--admin-key", action="append", default=None, metavar="KEY",
                       help=f"the key for /admin/* routes (repeat; or ${ADMIN_KEY_ENV})")
    group.add_argument("--admin-key-file", default=None, help="a file of admin keys, one per line")
    group.add_argument("--open-probes", action="store_true", help="/health and /metrics need no key")


def add_tls_args(parser) -> None:
    parser.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (PEM)")
    parser.add_argument("--ssl-certfile", default=None, help="... and this certificate chain (PEM)")


def tls_from_args(args) -> dict[str, str | None]:
    """ServerConfig / RouterConfig fields; one without the other is refused in one line."""
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ConfigError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    return {"ssl_keyfile": args.ssl_keyfile, "ssl_certfile": args.ssl_certfile}


def auth_from_args(args) -> AuthConfig:
    return auth_config(args.api_key, args.api_key_file, args.admin_key, args.admin_key_file, args.open_probes)


class AuthMiddleware:
    """ASGI middleware that answers 401 before the app sees a request it refuses."""

    def __init__(self, app, config: AuthConfig):
        self.app, self.config = app, config

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.config.enabled:
            return await self.app(scope, receive, send)
        reason = self.config.refusal(scope["path"], _bearer(scope))
        if reason is None:
            return await self.app(scope, receive, send)
        from shardserve.server.protocol import error_body

        body = json.dumps(error_body(401, reason)).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


def _bearer(scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return None
