"""deploy/: the Kubernetes manifests validate against the API's schemas (offline, from
kubernetes-validate) and ours for the LeaderWorkerSet CRD; their commands parse with our own CLI
and describe layouts that fit; the Slurm script is valid bash whose #SBATCH lines Slurm will
read, and, run with a fake srun, starts one `shardserve serve` per node with the right ranks."""
from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from shardserve.cli import build_parser

DEPLOY = Path(__file__).parents[2] / "deploy"
K8S_VERSION = "1.33.0"
LWS_SCHEMA = json.loads((Path(__file__).parent / "leaderworkerset.schema.json").read_text())
SBATCH = DEPLOY / "slurm" / "shardserve.sbatch"


def manifests() -> dict[str, dict]:
    """kind -> document, over every file in deploy/k8s (each kind appears once)."""
    docs = [doc for path in sorted((DEPLOY / "k8s").glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text())]
    kinds = [doc["kind"] for doc in docs]
    assert len(set(kinds)) == len(kinds), kinds
    return {doc["kind"]: doc for doc in docs}


def validate(doc: dict) -> None:
    """Raise unless `doc` is valid: built-in kinds against the Kubernetes schema (strict: unknown
    fields are errors); a LeaderWorkerSet against our CRD schema, its pod templates against
    Kubernetes' PodTemplateSpec."""
    if doc["kind"] != "LeaderWorkerSet":
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        return
    jsonschema.validate(doc, LWS_SCHEMA)
    template = doc["spec"]["leaderWorkerTemplate"]
    for role in ("leaderTemplate", "workerTemplate"):
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role.lower()},
                        "template": template[role]}
        kubernetes_validate.validate(pod_template, K8S_VERSION, strict=True)


def test_the_manifests_are_valid_kubernetes():
    docs = manifests()
    assert set(docs) == {"Deployment", "Service", "LeaderWorkerSet"}
    for doc in docs.values():
        validate(doc)


@pytest.mark.parametrize("kind, path, value", [
    ("Deployment", ["spec", "replica"], 1),  # misspelled
    ("Service", ["spec", "ports", 0, "port"], "eighty"),
    ("LeaderWorkerSet", ["spec", "leaderWorkerTemplate", "size"], "2"),
    ("LeaderWorkerSet", ["spec", "leaderWorkerTemplate", "restartPolicy"], "Always"),
    ("LeaderWorkerSet", ["spec", "leaderWorkerTemplate", "workerTemplate", "spec", "containers", 0, "comand"], ["x"]),
])
def test_the_validation_catches_mistakes(kind, path, value):
    doc = copy.deepcopy(manifests()[kind])
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises((kubernetes_validate.ValidationError, jsonschema.ValidationError)):
        validate(doc)


def container(pod_template: dict) -> dict:
    [only] = pod_template["spec"]["containers"]
    return only


def parse(command: list[str], env: dict[str, str] | None = None):
    """Our CLI's reading of a manifest's command, with $(VAR) expanded as Kubernetes does."""
    assert command[0] == "shardserve"
    args = [re.sub(r"\$\((\w+)\)", lambda m: (env or {})[m.group(1)], arg) for arg in command[1:]]
    return build_parser().parse_args(args)


def test_the_router_routes_to_every_replica_group_leader():
    docs = manifests()
    lws, deployment, service = docs["LeaderWorkerSet"], docs["Deployment"], docs["Service"]
    router = container(deployment["spec"]["template"])
    args = parse(router["command"])
    assert args.command == "route" and args.host == "0.0.0.0"
    leader = container(lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"])
    [http] = [p["containerPort"] for p in leader["ports"] if p["name"] == "http"]
    name = lws["metadata"]["name"]  # leader pods: <name>-<group>, DNS through the headless service <name>
    assert args.replica == [f"http://{name}-{i}.{name}:{http}" for i in range(lws["spec"]["replicas"])]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["selector"].items() <= pod_labels.items()
    [port] = service["spec"]["ports"]
    assert port["targetPort"] in [p["name"] for p in router["ports"]]
    assert args.port == next(p["containerPort"] for p in router["ports"] if p["name"] == port["targetPort"])


def test_every_pod_of_a_group_runs_the_same_layout_that_fits_its_gpus():
    template = manifests()["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    leader, worker = container(template["leaderTemplate"]), container(template["workerTemplate"])
    assert leader["command"] == worker["command"]
    size = template["size"]
    [dist_port] = {p["containerPort"] for c in (leader, worker) for p in c["ports"] if p["name"] == "dist"}
    for index in range(size):  # what each pod of a group sees
        env = {"LWS_GROUP_SIZE": str(size), "LWS_WORKER_INDEX": str(index), "LWS_LEADER_ADDRESS": "leader.svc"}
        args = parse(leader["command"], env)
        assert (args.command, args.nnodes, args.node_rank) == ("serve", size, index)
        assert args.dist_init_addr == f"leader.svc:{dist_port}"
    world_size = args.pp * max(args.tp, args.ep)
    assert world_size % size == 0
    for pod in (leader, worker):  # one GPU per rank on each node
        assert int(pod["resources"]["limits"]["nvidia.com/gpu"]) == world_size // size
    assert args.device == "cuda"


def sbatch_options() -> dict[str, str]:
    """The #SBATCH options Slurm reads: those before the script's first command (it stops there)."""
    options = {}
    for line in SBATCH.read_text().splitlines()[1:]:
        if line.startswith("#SBATCH"):
            key, _, value = line.split(maxsplit=1)[1].partition("=")
            options[key] = value
        elif line.strip() and not line.startswith("#"):
            break
    return options


def test_the_slurm_script_is_valid_bash_with_the_directives_slurm_reads():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    options = sbatch_options()
    all_directives = [line for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH")]
    assert len(options) == len(all_directives), "an #SBATCH line after the first command is ignored by Slurm"
    assert options["--ntasks-per-node"] == "1" and int(options["--nodes"]) >= 2
    assert int(options["--gpus-per-node"]) == 8 and "--job-name" in options and "--time" in options


def test_the_slurm_script_starts_one_server_per_node_with_its_rank(tmp_path):
    """Run it with stand-ins: scontrol lists the nodes, srun runs the command once per node with
    SLURM_PROCID set, and `shardserve` records its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_ins = {
        "scontrol": "#!/bin/bash\nprintf 'gpu-node-07\\ngpu-node-08\\n'\n",
        "srun": "#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\n"
                "for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do SLURM_PROCID=$i \"$@\"; done\n",
        "shardserve": f"#!{sys.executable}\nimport json, os, sys\n"
                      "open(os.environ['CALLS'], 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n",
    }
    for name, text in stand_ins.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls.jsonl"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls),
           "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu-node-[07-08]", "MODEL": "/models/m"}
    proc = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "API at http://gpu-node-07:8000/v1" in proc.stdout
    runs = [build_parser().parse_args(json.loads(line)) for line in calls.read_text().splitlines()]
    assert [(a.command, a.model_pos, a.node_rank, a.nnodes) for a in runs] == [("serve", "/models/m", 0, 2),
                                                                             ("serve", "/models/m", 1, 2)]
    for args in runs:
        assert (args.tp, args.pp, args.dist_init_addr, args.port) == (8, 2, "gpu-node-07:29500", 8000)
