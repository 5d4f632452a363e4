"""Autoscaling with real processes: a queue grows the group to its maximum; when the queue is
gone the group shrinks back, draining the replica it removes, and no request fails meanwhile.
Replicas run one sequence at a time (--max-num-seqs 1), so four streams queue three."""
from __future__ import annotations

from tests.cluster.cluster_process import running_cluster, serving, status, tiny_group, wait_for
from tests.cluster.constant_load import ConstantLoad

AUTOSCALE = {"min_replicas": 1, "max_replicas": 2, "scale_up_waiting_per_replica": 1.0,
             "scale_down_waiting_per_replica": 0.2, "cooldown_s": 1.0, "scale_down_stable_s": 2.0}


def test_the_group_grows_under_a_queue_and_drains_back_when_it_is_gone(tmp_path, tiny_checkpoints):
    group = tiny_group(tiny_checkpoints["llama"], autoscale=AUTOSCALE)
    group["serve_args"] = [*group["serve_args"], "--max-num-seqs", "1"]
    model = str(tiny_checkpoints["llama"])
    with running_cluster(tmp_path, [group]) as (url, _):
        with ConstantLoad(url, model, num_streams=4) as busy:
            wait_for(lambda: len(serving(url)) == 2, 40, "a second replica under load")
            assert status(url)["groups"][0]["target_replicas"] == 2
            wait_for(lambda: busy.num_ok() >= 8, 30, "requests on the grown group")
        # one stream queues nothing: the group shrinks, draining one replica, while it runs
        with ConstantLoad(url, model, num_streams=1) as light:
            wait_for(lambda: len(status(url)["replicas"]) == 1, 40, "the group back at one replica")
            wait_for(lambda: light.num_ok() >= 4, 30, "requests on the shrunk group")
        assert status(url)["groups"][0]["target_replicas"] == 1
        assert busy.failures() == [] and light.failures() == []
