"""Two ranks on two emulated hosts give the single-process output.

Each host is a network namespace; a veth pair is the only link between them, so the ranks'
rendezvous and gloo traffic must cross it:

    netns ss<pid>h0                              netns ss<pid>h1
    rank 0 (driver, prints)  ss<pid>v0 <----> ss<pid>v1  rank 1 (worker)
    10.231.0.1/24                                10.231.0.2/24

Both launchers are covered: `--nnodes 2 --node-rank R --dist-init-addr` and torchrun. Skipped
where namespaces cannot be created (not root, no CAP_NET_ADMIN).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pytest

PROMPT = "The quick brown fox"
MAX_TOKENS = 8
RUN_TIMEOUT_S = 120
MIN_LINK_BYTES = 10_000  # each direction; a run moves ~100 kB


@dataclass(frozen=True)
class Host:
    netns: str
    ifname: str  # its end of the veth pair
    addr: str

    def popen(self, cmd: list[str], out_path: Path, err_path: Path) -> subprocess.Popen:
        """`cmd` inside this host's namespace, with gloo bound to the veth."""
        env = {**os.environ, "GLOO_SOCKET_IFNAME": self.ifname}
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            return subprocess.Popen(["ip", "netns", "exec", self.netns, *cmd], stdout=out, stderr=err, env=env,
                                    start_new_session=True)

    def link_bytes(self) -> tuple[int, int]:
        """(rx, tx) byte counters of this host's veth end, read inside the namespace."""
        stats = f"/sys/class/net/{self.ifname}/statistics"
        out = _ip("netns", "exec", self.netns, "cat", f"{stats}/rx_bytes", f"{stats}/tx_bytes")
        rx_bytes, tx_bytes = (int(line) for line in out.split())
        return rx_bytes, tx_bytes


def _ip(*args: str) -> str:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout


@pytest.fixture(scope="module")
def two_hosts() -> Iterator[tuple[Host, Host]]:
    tag = f"ss{os.getpid()}"
    hosts = (Host(f"{tag}h0", f"{tag}v0", "10.231.0.1"), Host(f"{tag}h1", f"{tag}v1", "10.231.0.2"))
    created: list[str] = []
    try:
        for host in hosts:
            try:
                _ip("netns", "add", host.netns)
            except (OSError, RuntimeError) as exc:
                if created:
                    raise
                pytest.skip(f"cannot create a network namespace (needs root or CAP_NET_ADMIN): {exc}")
            created.append(host.netns)
        a, b = hosts
        _ip("link", "add", a.ifname, "netns", a.netns, "type", "veth", "peer", "name", b.ifname, "netns", b.netns)
        for host in hosts:
            _ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", host.ifname)
            _ip("-n", host.netns, "link", "set", "lo", "up")
            _ip("-n", host.netns, "link", "set", host.ifname, "up")
        yield hosts
    finally:
        for netns in created:  # the veth pair goes with its first end's namespace
            subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=30)


def generate_cmd(model: Path, *flags: str) -> list[str]:
    return ["-m", "shardserve.cli", "generate", "--model", str(model), "--prompt", PROMPT,
            "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--kv-cache-memory", str(1 << 22), *flags]


def run_on_hosts(hosts: tuple[Host, Host], cmd_for_node: Callable[[int], list[str]], tmp_path: Path) -> list[bytes]:
    """Run both nodes' commands at once; returns their stdouts. Fails on a non-zero exit, a
    timeout, or too little traffic across the link; no process outlives the call."""
    before = [host.link_bytes() for host in hosts]
    procs, logs = [], []
    for node_rank, host in enumerate(hosts):
        logs.append((tmp_path / f"node{node_rank}.out", tmp_path / f"node{node_rank}.err"))
        procs.append(host.popen(cmd_for_node(node_rank), *logs[-1]))
    try:
        codes = [proc.wait(RUN_TIMEOUT_S) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    for node_rank, (code, (_, err_path)) in enumerate(zip(codes, logs)):
        assert code == 0, f"node {node_rank} exited with {code}: {err_path.read_text()[-3000:]}"
    for host, (rx_before, tx_before) in zip(hosts, before):
        rx_bytes, tx_bytes = host.link_bytes()
        assert rx_bytes - rx_before >= MIN_LINK_BYTES and tx_bytes - tx_before >= MIN_LINK_BYTES, \
            f"{host.ifname}: only {rx_bytes - rx_before} bytes in, {tx_bytes - tx_before} out"
    return [out_path.read_bytes() for out_path, _ in logs]


@pytest.fixture(scope="module")
def single_process_output(tiny_checkpoints) -> bytes:
    proc = subprocess.run([sys.executable, *generate_cmd(tiny_checkpoints["llama"])], capture_output=True,
                          timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert proc.stdout.startswith(PROMPT.encode()) and len(proc.stdout) > len(PROMPT) + 1
    return proc.stdout


def test_dist_init_addr_across_hosts(two_hosts, tiny_checkpoints, single_process_output, tmp_path):
    flags = ["--tp", "2", "--nnodes", "2", "--dist-init-addr", f"{two_hosts[0].addr}:29500"]
    outs = run_on_hosts(two_hosts, lambda node_rank: [
        sys.executable, *generate_cmd(tiny_checkpoints["llama"], *flags, "--node-rank", str(node_rank))], tmp_path)
    assert outs == [single_process_output, b""]  # the driver prints; the worker only serves


def test_torchrun_across_hosts(two_hosts, tiny_checkpoints, single_process_output, tmp_path):
    def torchrun(node_rank: int) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
                "--nproc-per-node", "1", "--master-addr", two_hosts[0].addr, "--master-port", "29501",
                *generate_cmd(tiny_checkpoints["llama"], "--tp", "2")]

    outs = run_on_hosts(two_hosts, torchrun, tmp_path)
    assert outs == [single_process_output, b""]
