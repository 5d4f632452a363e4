"""The cluster's admin endpoints, added to the router's app (the router's own /admin/status and
/admin/replicas stay as they are):

    GET  /admin/cluster                          groups (layout, target), supervised replicas
                                                 (state, layout, pid, restarts), the last reshard
    POST /admin/reshard {"group"?, "tp"?, "pp"?, "ep"?, "replicas"?}
                                                 202 and the reshard's progress; it runs in the
                                                 background (poll /admin/cluster); 409 while one runs
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from shardserve.cluster.reshard import ReshardError, start_reshard
from shardserve.cluster.supervisor import Supervisor
from shardserve.server.protocol import error_body

RESHARD_KEYS = {"group", "tp", "pp", "ep", "replicas"}


def add_cluster_routes(app: FastAPI, supervisor: Supervisor) -> None:
    @app.get("/admin/cluster")
    async def cluster_status():
        return supervisor.status()

    @app.post("/admin/reshard")
    async def reshard(request: Request):
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ReshardError(400, "the body must be a JSON object")
            unknown = sorted(set(body) - RESHARD_KEYS)
            if unknown:
                raise ReshardError(400, f"unknown fields {', '.join(unknown)}; "
                                        f"known: {', '.join(sorted(RESHARD_KEYS))}")
            for key in ("tp", "pp", "ep", "replicas"):
                if key in body and (not isinstance(body[key], int) or isinstance(body[key], bool)):
                    raise ReshardError(400, f"{key} must be an integer")
            layout = {k: body[k] for k in ("tp", "pp", "ep") if k in body}
            progress = await start_reshard(supervisor, body.get("group"), layout, body.get("replicas"))
        except ValueError:
            return JSONResponse(error_body(400, "the body is not valid JSON"), status_code=400)
        except ReshardError as exc:
            return JSONResponse(error_body(exc.status, exc.message), status_code=exc.status)
        return JSONResponse(progress.as_dict(), status_code=202)
