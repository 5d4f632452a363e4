"""API keys: the rule (AuthConfig.refusal), where keys come from, and real servers and a real
router behind them, called with the official openai client."""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time

import httpx
import openai
import pytest

from shardserve.cluster.config import ClusterConfig, ReplicaGroup, SupervisorConfig
from shardserve.cluster.supervisor import Supervisor
from shardserve.config import ConfigError, RouterConfig
from shardserve.ports import free_port
from shardserve.router.app import Router
from shardserve.server.auth import ADMIN_KEY_ENV, API_KEY_ENV, AuthConfig, auth_config
from shardserve.server.process import server_process
from tests.cluster.test_supervisor_states import FakeProcess, settle
from tests.server_process import running_server

USER, ADMIN, OTHER = "user-key-0123", "admin-key-4567", "wrong-key-8901"


@pytest.mark.parametrize("config, path, key, allowed", [
    (AuthConfig(), "/v1/completions", None, True),  # no key configured: open
    (AuthConfig(), "/admin/status", None, True),
    (AuthConfig(api_keys=(USER,)), "/v1/completions", USER, True),
    (AuthConfig(api_keys=(USER,)), "/v1/completions", None, False),
    (AuthConfig(api_keys=(USER,)), "/v1/completions", OTHER, False),
    (AuthConfig(api_keys=(USER,)), "/v1/completions", USER[:-1], False),  # a prefix is not the key
    (AuthConfig(api_keys=(USER,)), "/health", None, False),
    (AuthConfig(api_keys=(USER,), open_probes=True), "/health", None, True),
    (AuthConfig(api_keys=(USER,), open_probes=True), "/metrics", None, True),
    (AuthConfig(api_keys=(USER,), open_probes=True), "/v1/models", None, False),
    (AuthConfig(api_keys=(USER,)), "/admin/status", USER, False),  # no admin key: admin closed
    (AuthConfig(api_keys=(USER,), admin_keys=(ADMIN,)), "/admin/status", USER, False),
    (AuthConfig(api_keys=(USER,), admin_keys=(ADMIN,)), "/admin/replicas", ADMIN, True),
    (AuthConfig(api_keys=(USER,), admin_keys=(ADMIN,)), "/v1/completions", ADMIN, True),
    (AuthConfig(api_keys=(USER,), admin_keys=(ADMIN,)), "/administrator", USER, True),  # not under /admin/
    (AuthConfig(admin_keys=(ADMIN,)), "/v1/completions", None, False),  # any key turns auth on
    (AuthConfig(api_keys=("k-one-12345", USER)), "/v1/completions", USER, True),  # any of several
])
def test_refusal_rule(config, path, key, allowed):
    assert (config.refusal(path, key) is None) == allowed


def test_keys_from_flags_file_and_environment(tmp_path, monkeypatch):
    key_file = tmp_path / "keys"
    key_file.write_text(f"# team keys\n{USER}\n\nfile-key-2222\n")
    monkeypatch.setenv(API_KEY_ENV, "env-key-33333")
    monkeypatch.setenv(ADMIN_KEY_ENV, ADMIN)
    config = auth_config(["flag-key-1111"], str(key_file))
    assert config.api_keys == ("flag-key-1111", USER, "file-key-2222", "env-key-33333")
    assert config.admin_keys == (ADMIN,)
    assert config.child_env() == {API_KEY_ENV: "flag-key-1111", ADMIN_KEY_ENV: ADMIN}


@pytest.mark.parametrize("kwargs, message", [
    (dict(api_keys=["short"]), "at least 8 characters"),
    (dict(api_key_file="/no/such/keys"), "/no/such/keys"),
])
def test_bad_keys_are_config_errors(kwargs, message, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with pytest.raises(ConfigError, match=message):
        auth_config(**kwargs)


@pytest.fixture(scope="module")
def keyed_server(tiny_checkpoints):
    """A replica that takes USER, and ADMIN for /admin."""
    args = [str(tiny_checkpoints["llama"]), "--kv-cache-memory", str(4 << 20), "--api-key", USER, "--admin-key", ADMIN]
    with running_server(*args, headers={"Authorization": f"Bearer {USER}"}) as (url, _):
        yield url, str(tiny_checkpoints["llama"])


def test_server_refuses_missing_and_wrong_keys_and_generates_nothing(keyed_server):
    url, model = keyed_server
    auth = {"Authorization": f"Bearer {USER}"}
    served_before = scrape_with(url, auth, "vllm:prompt_tokens_total")
    for key in (OTHER, ADMIN[:-1]):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as refused:
            client.completions.create(model=model, prompt="hello", max_tokens=4)
        assert refused.value.status_code == 401 and refused.value.body["message"] == "invalid API key"
    missing = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 4})
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert missing.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{url}/health").status_code == 401  # no --open-probes
    assert scrape_with(url, auth, "vllm:prompt_tokens_total") == served_before  # nothing generated
    ok = openai.OpenAI(base_url=f"{url}/v1", api_key=USER, max_retries=0)
    assert ok.completions.create(model=model, prompt="hello", max_tokens=4, temperature=0).usage.completion_tokens == 4
    assert scrape_with(url, auth, "vllm:prompt_tokens_total") > served_before


def scrape_with(url: str, headers: dict, name: str) -> float:
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_router_passes_its_key_and_guards_admin(keyed_server):
    """The router holds the replicas' key (its probes and requests get through) and its own admin
    key: the user key cannot add a replica, and a refused admin call changes nothing."""
    replica_url, model = keyed_server
    port = free_port()
    cmd = [sys.executable, "-m", "shardserve.cli", "route", "--port", str(port), "--replica", replica_url,
           "--api-key", USER, "--admin-key", ADMIN, "--open-probes", "--probe-interval", "0.5"]
    with server_process(cmd, port) as (router_url, _):  # --open-probes: /health answers without a key
        client = openai.OpenAI(base_url=f"{router_url}/v1", api_key=USER, max_retries=0)
        answer = client.completions.create(model=model, prompt="hello", max_tokens=4, temperature=0)
        assert answer.usage.completion_tokens == 4
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{router_url}/v1", api_key=OTHER, max_retries=0).models.list()
        extra = {"url": "http://127.0.0.1:9"}
        as_user = httpx.post(f"{router_url}/admin/replicas", json=extra, headers={"Authorization": f"Bearer {USER}"})
        assert as_user.status_code == 401
        status = httpx.get(f"{router_url}/admin/status", headers={"Authorization": f"Bearer {ADMIN}"}).json()
        assert [r["url"] for r in status["replicas"]] == [replica_url]  # unchanged
        assert status["replicas"][0]["state"] == "healthy"  # the probes carry the key
        assert httpx.get(f"{router_url}/metrics").status_code == 200  # open too


def test_a_cluster_probes_its_replicas_with_its_key(tmp_path):
    """The supervisor's readiness probes and the router's calls carry the cluster's API key (the
    replicas take the same keys from the environment the cluster exports: child_env)."""
    probed_with: list[str | None] = []

    class KeyCheckingProcess(FakeProcess):
        async def wait_ready(self, client, timeout_s):
            probed_with.append(client.headers.get("authorization"))
            return None

    async def main():
        router = Router(RouterConfig(), AuthConfig(api_keys=(USER,), admin_keys=(ADMIN,)))
        config = ClusterConfig(RouterConfig(), (ReplicaGroup(name="llama", model="m", replicas=2),), SupervisorConfig())
        supervisor = Supervisor(config, router, tmp_path, start_process=KeyCheckingProcess)
        supervisor.tick(time.monotonic())
        await settle(supervisor)
        await supervisor.shutdown()
        assert router.client.headers["authorization"] == f"Bearer {USER}"
        await router.client.aclose()

    asyncio.run(main())
    assert probed_with == [f"Bearer {USER}"] * 2


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_https_with_a_key(tiny_checkpoints, tmp_path):
    """--ssl-keyfile / --ssl-certfile: the openai client talks HTTPS (verifying a self-signed
    certificate) and still needs the key."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    trust = ssl.create_default_context(cafile=str(cert))
    port = free_port()
    cmd = [sys.executable, "-m", "shardserve.cli", "serve", str(tiny_checkpoints["llama"]), "--port", str(port),
           "--kv-cache-memory", str(4 << 20), "--api-key", USER, "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"https://127.0.0.1:{port}"
    try:
        with httpx.Client(verify=trust, headers={"Authorization": f"Bearer {USER}"}, timeout=2) as http:
            deadline = time.monotonic() + 120
            while True:
                assert proc.poll() is None and time.monotonic() < deadline, "the HTTPS server did not come up"
                try:
                    if http.get(f"{url}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.3)
        with httpx.Client(verify=trust) as tls:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=USER, http_client=tls, max_retries=0)
            answer = client.completions.create(model=str(tiny_checkpoints["llama"]), prompt="hi", max_tokens=3)
            assert answer.usage.completion_tokens == 3
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=f"{url}/v1", api_key=OTHER, http_client=tls, max_retries=0).models.list()
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not served
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def test_half_a_tls_setup_is_a_one_line_error():
    proc = subprocess.run([sys.executable, "-m", "shardserve.cli", "serve", "--ssl-keyfile", "k.pem"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--ssl-certfile" in proc.stderr and "Traceback" not in proc.stderr
