"""The cluster file: a full example loads into frozen dataclasses; each mistake is one line that
names the key; the CLI prints it without a traceback."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shardserve.cluster.config import (AutoscaleConfig, Layout, check_layout, cluster_config_from_dict,
                                       load_cluster_config)
from shardserve.config import ConfigError

EXAMPLE = Path(__file__).parents[2] / "deploy" / "cluster.example.yaml"


def minimal(**group) -> dict:
    return {"groups": [{"name": "llama", "model": "m", **group}]}


def test_the_example_file_loads(tmp_path):
    config = load_cluster_config(EXAMPLE)
    assert config.router.port == 8080 and config.router.replicas == ()
    llama = config.group("llama")
    assert llama.layout == Layout(tp=2, pp=1, ep=1) and llama.layout.world_size == 2
    assert llama.autoscale.min_replicas == 1 and llama.autoscale.max_replicas == 3
    assert isinstance(llama.serve_args, tuple) and all(isinstance(a, str) for a in llama.serve_args)
    with pytest.raises(dataclasses.FrozenInstanceError):
        llama.replicas = 3


def test_defaults_and_relative_model_paths(tmp_path):
    (tmp_path / "weights").mkdir()
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "a", "model": "weights"}, {"name": "b", "model": "smollm2"}]}))
    config = load_cluster_config(path)
    a, b = config.groups
    assert a.model == str(tmp_path / "weights") and b.model == "smollm2"  # a name that is no file stays a name
    assert a.layout == Layout() and a.replicas == 1 and a.autoscale is None and a.dtype == "float32"
    assert config.supervisor.devices == () and config.router.policy == "least_outstanding"


def test_router_and_supervisor_sections_reach_their_configs():
    config = cluster_config_from_dict({**minimal(), "router": {"port": 9000, "probe_interval_s": 0.5},
                                       "supervisor": {"devices": [0, 1, 2, 3], "restart_backoff_s": 2}})
    assert config.router.port == 9000 and config.router.probe_interval_s == 0.5
    assert config.supervisor.devices == (0, 1, 2, 3) and config.supervisor.restart_backoff_s == 2.0


@pytest.mark.parametrize("data, message", [
    ({}, "groups: give a list"),
    ({"groups": []}, "groups: give a list"),
    (minimal(tp=0), "groups[0].tp: must be at least 1"),
    (minimal(tp="2"), "groups[0].tp: expected int, got '2'"),
    (minimal(replicas=0), "groups[0].replicas: must be at least 1"),
    (minimal(dtype="fp8"), "groups[0].dtype: one of float32, bfloat16, float16"),
    (minimal(serve_args="--x"), "groups[0].serve_args: a list"),
    (minimal(gpus=2), "groups[0]: unknown keys gpus"),
    ({"groups": [{"name": "llama"}]}, "groups[0].model: required"),
    ({"groups": [{"name": "a", "model": "m"}, {"name": "a", "model": "m"}]}, "names must differ"),
    (minimal(autoscale={"min_replicas": 2, "max_replicas": 1}, replicas=2),
     "max_replicas: must be at least min_replicas"),
    (minimal(autoscale={"min_replicas": 0}), "min_replicas: must be at least 1"),
    (minimal(autoscale={"max_replicas": 3}, replicas=4), "groups[0].replicas: must be within autoscale's 1..3"),
    (minimal(autoscale={"max_replicas": 3, "scale_down_waiting_per_replica": 5}), "or the group would flap"),
    (minimal(autoscale={"max_replicas": 3, "kv_usage_high": 1.5}), "need 0 <= low < high <= 1"),
    (minimal(autoscale={"max_replicas": 3, "cooldown": 5}), "autoscale: unknown keys cooldown"),
    ({**minimal(), "router": {"replicas": ["http://x"]}}, "router: unknown keys replicas"),
    ({**minimal(), "router": {"max_attempts": 0}}, "router: max_attempts and max_outstanding_per_replica"),
    ({**minimal(), "supervisor": {"devices": "0,1"}}, "supervisor.devices: expected a list"),
    ({**minimal(), "extra": 1}, "unknown keys extra"),
])
def test_mistakes_are_one_line_errors_naming_the_key(data, message):
    with pytest.raises(ConfigError) as info:
        cluster_config_from_dict(data, source="c.yaml")
    text = str(info.value)
    assert message in text and text.startswith("c.yaml") and "\n" not in text


def test_a_layout_that_cannot_split_the_model_is_refused(tiny_checkpoints):
    model = str(tiny_checkpoints["llama"])  # 4 heads, 2 KV heads, 2 layers, dense
    check_layout(model, Layout(tp=2, pp=2))
    for layout, message in ((Layout(tp=3), "tp=3 does not divide"), (Layout(pp=3), "pp=3 exceeds"),
                            (Layout(ep=2), "dense")):
        with pytest.raises(ConfigError, match=message):
            check_layout(model, layout)


def test_the_cli_prints_a_bad_cluster_file_in_one_line(tmp_path, tiny_checkpoints):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(minimal(autoscale=AutoscaleConfig().__dict__ | {"max_replicas": 0})))
    wrong_layout = tmp_path / "layout.yaml"
    wrong_layout.write_text(yaml.safe_dump({"groups": [{"name": "l", "model": str(tiny_checkpoints["llama"]),
                                                        "tp": 3}]}))
    for path, message in ((bad, "max_replicas: must be at least min_replicas"), (wrong_layout, "tp=3")):
        proc = subprocess.run([sys.executable, "-m", "shardserve.cli", "cluster", "--config", str(path)],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert proc.stderr.startswith("shardserve: error:") and message in proc.stderr, proc.stderr


def test_only_serve_reads_its_config_file_as_flag_defaults(tmp_path):
    from shardserve.cli import read_config_file

    path = tmp_path / "flags.yaml"
    path.write_text("max-num-seqs: 4\n")
    assert read_config_file(["serve", "m", "--config", str(path)]) == {"max_num_seqs": 4}
    assert read_config_file(["cluster", "--config", str(path)]) == {}  # the cluster file is not serve flags
