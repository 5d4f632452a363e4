"""`shardserve cluster`: run a cluster on this host, or act on a running one.

    shardserve cluster --config cluster.yaml [--port 8080]
    shardserve cluster status --url http://127.0.0.1:8080
    shardserve cluster reshard --url http://127.0.0.1:8080 [--group G] --tp 2 --replicas 1

`reshard` asks the cluster to change a group's layout (unnamed dimensions and the count stay as
they are), then follows it until the old replicas are stopped. Refusals are one-line errors
(exit 2); a reshard that fails while running exits 1, and the old layout keeps serving.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import httpx

from shardserve.config import ConfigError
from shardserve.server.auth import ADMIN_KEY_ENV, AuthConfig, add_auth_args

POLL_S = 0.5


def add_cluster_parser(sub) -> None:
    cluster = sub.add_parser("cluster", help="a router and supervised replicas on this host; live resharding")
    cluster.add_argument("--config", help="the cluster file (YAML; see shardserve/cluster/config.py)")
    cluster.add_argument("--host", default=None, help="the router's address (default: the file's router.host)")
    cluster.add_argument("--port", type=int, default=None, help="the router's port (default: the file's router.port)")
    cluster.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_auth_args(cluster)
    cluster.set_defaults(func=cmd_cluster)
    actions = cluster.add_subparsers(dest="cluster_command", metavar="{status,reshard}")
    status = actions.add_parser("status", help="print a running cluster's groups, replicas and last reshard")
    status.add_argument("--url", required=True, help="the cluster's router, e.g. http://127.0.0.1:8080")
    _add_remote_key(status)
    reshard = actions.add_parser("reshard", help="change a group's layout while it serves")
    reshard.add_argument("--url", required=True, help="the cluster's router, e.g. http://127.0.0.1:8080")
    _add_remote_key(reshard)
    reshard.add_argument("--group", default=None, help="the group to reshard (needed when there are several)")
    for dim in ("tp", "pp", "ep"):
        reshard.add_argument(f"--{dim}", type=int, default=None, help=f"new {dim} (default: unchanged)")
    reshard.add_argument("--replicas", type=int, default=None, help="replicas of the new layout (default: unchanged)")
    reshard.add_argument("--no-wait", action="store_true", help="return once the reshard has started")
    reshard.add_argument("--timeout", type=float, default=1800.0, help="seconds to follow it before giving up")


def _add_remote_key(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--admin-key", dest="remote_admin_key", default=None, metavar="KEY",
                        help=f"the cluster's admin key (default: ${ADMIN_KEY_ENV})")


def _admin_headers(args: argparse.Namespace) -> dict[str, str]:
    key = args.remote_admin_key or os.environ.get(ADMIN_KEY_ENV)
    return AuthConfig(admin_keys=(key,) if key else ()).bearer_header()


def cmd_cluster(args: argparse.Namespace) -> int:
    if args.cluster_command == "status":
        print(json.dumps(_get_status(args.url, _admin_headers(args)), indent=2))
        return 0
    if args.cluster_command == "reshard":
        return cmd_reshard(args)
    if not args.config:
        raise ConfigError("cluster: give --config cluster.yaml (or a command: status, reshard)")
    from shardserve.cluster.config import load_cluster_config
    from shardserve.cluster.serve import run_cluster
    from shardserve.server.auth import auth_from_args

    config = load_cluster_config(args.config)
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    router = dataclasses.replace(config.router, log_level=args.log_level, **overrides)
    return run_cluster(dataclasses.replace(config, router=router), auth_from_args(args))


def cmd_reshard(args: argparse.Namespace) -> int:
    from shardserve.cluster.reshard import ReshardState

    url = args.url.rstrip("/")
    body = {k: getattr(args, k) for k in ("group", "tp", "pp", "ep", "replicas") if getattr(args, k) is not None}
    try:
        headers = _admin_headers(args)
        response = httpx.post(f"{url}/admin/reshard", json=body, headers=headers, timeout=60)
    except httpx.HTTPError as exc:
        raise ConfigError(f"cannot reach the cluster at {url}: {exc}") from None
    if response.status_code != 202:
        raise ConfigError(f"reshard refused: {_message(response)}")
    progress = response.json()
    print(f"resharding {progress['group']}: {_describe(progress['from'])} -> {_describe(progress['to'])}", flush=True)
    if args.no_wait:
        return 0
    deadline = time.monotonic() + args.timeout
    while ReshardState(progress["state"]).running:
        if time.monotonic() > deadline:
            print(f"shardserve: still {progress['state']} after {args.timeout:.0f} s; see {url}/admin/cluster",
                  file=sys.stderr)
            return 1
        time.sleep(POLL_S)
        progress = _get_status(url, headers)["reshard"]
    if progress["state"] != ReshardState.DONE:
        print(f"shardserve: reshard failed, the old layout still serves: {progress['error']}", file=sys.stderr)
        return 1
    print(f"resharded {progress['group']} in {progress['elapsed_s']:.1f} s")
    return 0


def _get_status(url: str, headers: dict[str, str]) -> dict:
    try:
        response = httpx.get(f"{url.rstrip('/')}/admin/cluster", headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        raise ConfigError(f"cannot reach the cluster at {url}: {exc}") from None
    if response.status_code != 200:
        raise ConfigError(f"{url} answered {response.status_code} (is it a `shardserve cluster`?): "
                          f"{_message(response)}")
    return response.json()


def _describe(side: dict) -> str:
    layout = side["layout"]
    return f"{side['replicas']} x tp={layout['tp']} pp={layout['pp']} ep={layout['ep']}"


def _message(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:200]
