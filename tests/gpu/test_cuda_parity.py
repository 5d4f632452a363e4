"""On a GPU (skipped elsewhere): the engine in bfloat16 on CUDA, with the Triton backend and
kernels, against transformers on the same device and weights, for a dense and an MoE family.
benchmarks/gpu_check.py runs this first on a lent device."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import transformers  # noqa: E402

from shardserve import SamplingParams  # noqa: E402
from shardserve.llm import LLM  # noqa: E402
from tests.conftest import write_tiny_checkpoint  # noqa: E402
from tests.engine_helpers import engine_logits, relative_error  # noqa: E402

FAMILIES = ["llama3", "qwen3", "mixtral", "qwen3_moe"]


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    # well-conditioned weights: where bfloat16 rounding alone moves the logits 5-50%, two correct
    # bf16 implementations cannot agree to 1e-2 (tests/conftest.py)
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, well_conditioned=True)
    ours = LLM(str(path), dtype="bfloat16", device="cuda", kv_cache_memory_bytes=64 << 20, max_model_len=512,
               show_progress=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    return request.param, ours, ref


@pytest.mark.parametrize("chunk_size", [10**6, 5, 1], ids=["prefill", "chunked", "decode"])
def test_bf16_logits_match_transformers_on_cuda(pair, chunk_size):
    family, ours, ref = pair
    assert ours.engine.runner.attention.name == "triton"
    ids = list(range(3, 40))
    with torch.no_grad():
        expected = ref(torch.tensor([ids], device="cuda")).logits[0].float()
    got = engine_logits(ours.engine, ids, chunk_size).float()
    assert relative_error(got, expected) <= 1e-2, family


def test_greedy_generation_runs_on_cuda(pair):
    family, ours, ref = pair
    out = ours.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=8, min_tokens=8))[0]
    assert len(out.outputs[0].token_ids) == 8
    with torch.no_grad():  # bf16 drifts between two implementations over many tokens; the first agrees
        first = int(ref(torch.tensor([[5, 6, 7, 8]], device="cuda")).logits[0, -1].argmax())
    assert out.outputs[0].token_ids[0] == first, family
