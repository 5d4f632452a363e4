"""Live resharding under constant load: two tp=1 replicas become one tp=2 replica while four
clients stream back to back. No request fails; the router's status and /v1/models show the old
layout before and the new one after; the old replicas' processes are gone."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx

from tests.cluster.cluster_process import alive, process_tree, running_cluster, status, tiny_group, wait_for
from tests.cluster.constant_load import ConstantLoad

TP1 = {"tp": 1, "pp": 1, "ep": 1, "world_size": 1}
TP2 = {"tp": 2, "pp": 1, "ep": 1, "world_size": 2}


def routed_layouts(url: str) -> list[dict]:
    """The layout of each replica the router routes to, from its model cards."""
    return [r["model"]["layout"] for r in httpx.get(f"{url}/admin/status", timeout=5).json()["replicas"]]


def reshard_cli(url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardserve.cli", "cluster", "reshard", "--url", url, *args],
                          capture_output=True, text=True, timeout=120)


def test_two_tp1_replicas_become_one_tp2_replica_under_load_without_a_failed_request(tmp_path, tiny_checkpoints):
    model = str(tiny_checkpoints["llama"])
    with running_cluster(tmp_path, [tiny_group(tiny_checkpoints["llama"], replicas=2)]) as (url, _):
        old = [p for r in status(url)["replicas"] for p in process_tree(r["pid"])]
        assert routed_layouts(url) == [TP1, TP1]
        with ConstantLoad(url, model, num_streams=4) as load:
            wait_for(lambda: load.num_ok() >= 8, 30, "load on the old layout")
            started_s = time.monotonic()
            proc = reshard_cli(url, "--tp", "2", "--replicas", "1")
            finished_s = time.monotonic()
            assert proc.returncode == 0, proc.stdout + proc.stderr
            assert "resharding llama: 2 x tp=1 pp=1 ep=1 -> 1 x tp=2 pp=1 ep=1" in proc.stdout
            wait_for(lambda: load.num_ok(since_s=finished_s) >= 8, 30, "load on the new layout")
        print(f"\nreshard 2 x tp=1 -> 1 x tp=2 took {finished_s - started_s:.1f} s; {len(load.outcomes)} streamed "
              f"requests, {load.num_ok(started_s) - load.num_ok(finished_s)} started during the reshard, "
              f"{len(load.failures())} failed")
        assert load.failures() == []
        assert load.num_ok(started_s) - load.num_ok(finished_s) > 0  # the switch happened under load
        assert routed_layouts(url) == [TP2]
        [card] = httpx.get(f"{url}/v1/models", timeout=5).json()["data"]
        assert card["layout"] == TP2 and [r["layout"] for r in card["replicas"]] == [TP2]
        after = status(url)
        assert after["reshard"]["state"] == "done" and after["reshard"]["from"]["layout"] == TP1
        assert after["groups"][0]["layout"] == TP2 and after["groups"][0]["target_replicas"] == 1
        assert [(r["layout"], r["state"]) for r in after["replicas"]] == [(TP2, "serving")]
        assert alive(old) == []


def test_a_layout_that_cannot_work_is_refused_and_the_old_one_serves_on(tmp_path, tiny_checkpoints):
    with running_cluster(tmp_path, [tiny_group(tiny_checkpoints["llama"])]) as (url, _):
        proc = reshard_cli(url, "--tp", "3")
        assert proc.returncode == 2
        assert proc.stderr.startswith("shardserve: error: reshard refused: tp=3 does not divide")
        answer = httpx.post(f"{url}/admin/reshard", json={"group": "mistral", "tp": 2}, timeout=10)
        assert answer.status_code == 404
        answer = httpx.post(f"{url}/admin/reshard", json={"tp": "2"}, timeout=10)
        assert answer.status_code == 400 and "tp must be an integer" in answer.json()["error"]["message"]
        assert routed_layouts(url) == [TP1] and status(url)["reshard"] is None
        shown = subprocess.run([sys.executable, "-m", "shardserve.cli", "cluster", "status", "--url", url],
                               capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0 and json.loads(shown.stdout)["groups"][0]["layout"] == TP1
