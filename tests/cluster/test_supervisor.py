"""The supervisor with real processes: a replica that dies is restarted (new process, same name)
while the others serve; stopping the cluster stops every replica; killing the cluster outright
takes its replicas, spawned ranks included, with it."""
from __future__ import annotations

import os
import signal

import httpx

from tests.cluster.cluster_process import alive, process_tree, running_cluster, serving, status, tiny_group, wait_for


def test_a_killed_replica_is_restarted_and_nothing_is_left_behind(tmp_path, tiny_checkpoints):
    model = str(tiny_checkpoints["llama"])
    with running_cluster(tmp_path, [tiny_group(tiny_checkpoints["llama"], replicas=2)]) as (url, _):
        victim = serving(url)[0]
        os.killpg(victim["pid"], signal.SIGKILL)

        def restarted():
            now = {r["name"]: r for r in serving(url)}
            again = now.get(victim["name"])
            return len(now) == 2 and again and again["pid"] != victim["pid"] and again["num_restarts"] == 1 and again

        again = wait_for(restarted, 30, f"{victim['name']} to be restarted")
        assert "exited with code -9" in again["last_error"] and again["url"] != victim["url"]
        routed = httpx.get(f"{url}/admin/status", timeout=5).json()["replicas"]
        assert sorted(r["url"] for r in routed) == sorted(r["url"] for r in serving(url))
        answer = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 4},
                            timeout=30)
        assert answer.status_code == 200, answer.text
        owned = [p for r in serving(url) for p in process_tree(r["pid"])]
        assert len(owned) == 2
    assert alive(owned) == []  # the cluster stopped them before it exited


def test_killing_the_cluster_takes_its_replicas_with_it(tmp_path, tiny_checkpoints):
    with running_cluster(tmp_path, [tiny_group(tiny_checkpoints["llama"], tp=2)]) as (url, proc):
        [replica] = status(url)["replicas"]
        owned = process_tree(replica["pid"])
        assert len(owned) >= 2  # the driver, its spawned tp rank (and multiprocessing's resource tracker)
        os.killpg(proc.pid, signal.SIGKILL)  # no chance to stop anything itself
        wait_for(lambda: not alive(owned), 20, "the replica's processes to exit")
