"""One server of the embedded model (served as "smol") for every test module that only talks to
it, and the offline engine its answers are checked against: started once, not once a module."""
import openai
import pytest

from shardserve.llm import LLM
from tests.server_process import running_server

ENGINE_ARGS = ["--model", "smollm2", "--kv-cache-memory", str(64 << 20), "--max-model-len", "1024"]


@pytest.fixture(scope="session")
def server():
    with running_server(*ENGINE_ARGS, "--served-model-name", "smol") as (url, _):
        yield url


@pytest.fixture(scope="session")
def offline():
    return LLM("smollm2", dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=1024, show_progress=False)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused")


@pytest.fixture
def async_client(server):
    return openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused")
