"""Parallel layouts give the single-process engine's and transformers' greedy tokens, and
logprobs over the whole vocabulary within 1e-4 (float32). Each layout runs as a subprocess
whose ranks are real processes joined by gloo."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.engine_helpers import relative_error
from tests.parallel.generate_json import PROMPTS, generate

SCRIPT = Path(__file__).with_name("generate_json.py")
MAX_TOKENS = 6


def run_layout(model: Path, tp: int = 1, pp: int = 1, ep: int = 1, micro: int | None = None,
               speculative: str | None = None, quantization: str | None = None) -> dict:
    cmd = [sys.executable, str(SCRIPT), str(model), "--tp", str(tp), "--pp", str(pp), "--ep", str(ep),
           "--max-tokens", str(MAX_TOKENS)]
    if quantization:
        cmd += ["--quantization", quantization]
    if micro:
        cmd += ["--num-micro-batches", str(micro)]
    if speculative:
        cmd += ["--speculative", speculative]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def hf_reference(model_path: Path) -> dict:
    """transformers' greedy tokens and per-step log-softmax for the same prompts."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    result = {"tokens": [], "logprobs": []}
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS,
                             min_new_tokens=MAX_TOKENS, pad_token_id=0)
        generated = out[0, len(prompt):].tolist()
        with torch.no_grad():
            logits = model(out[:, :-1]).logits[0, len(prompt) - 1:]  # the steps that chose each token
        result["tokens"].append(generated)
        result["logprobs"].append(torch.log_softmax(logits.float(), -1).tolist())
    return result


@pytest.fixture(scope="module")
def references(tiny_checkpoints):
    cache = {}

    def get(family: str) -> tuple[dict, dict]:
        if family not in cache:
            path = tiny_checkpoints[family]
            cache[family] = (generate(str(path), max_tokens=MAX_TOKENS), hf_reference(path))
        return cache[family]
    return get


def assert_same(result: dict, single: dict, hf: dict) -> None:
    assert result["tokens"] == result["greedy_tokens"] == single["tokens"] == hf["tokens"]
    for ours, ref in zip(result["logprobs"], hf["logprobs"]):
        assert relative_error(torch.tensor(ours), torch.tensor(ref)) <= 1e-4


LAYOUTS = [
    ("llama", dict(tp=2)),
    ("llama", dict(pp=2)),
    ("llama", dict(tp=2, pp=2)),
    ("mistral", dict(tp=2)),  # one KV head, replicated on both ranks
    ("qwen2", dict(pp=2, micro=3)),  # biases; three micro-batches in flight
    ("mixtral", dict(ep=2)),  # attention repeated on both ranks, experts split, all_to_all
    ("mixtral", dict(tp=2)),  # every expert split by its intermediate features
    ("mixtral", dict(tp=2, ep=2)),  # attention tp, experts ep, on the same two ranks
    ("qwen2_moe", dict(tp=2, ep=2)),  # shared expert (tp) and a dense layer
    ("qwen3_moe", dict(ep=2, pp=2)),  # q/k norm; four ranks
    ("llama", dict(tp=2, pp=2, speculative="ngram")),  # verified chunks across tp ranks and pipeline micro-batches
    ("qwen2", dict(tp=2, speculative="self-draft")),  # the draft, whole, on the driver; every guess holds
]


@pytest.mark.parametrize("family,layout", LAYOUTS, ids=[f"{f}-{'-'.join(f'{k}{v}' for k, v in l.items())}" for f, l in LAYOUTS])
def test_layouts_match_single_process_and_transformers(tiny_checkpoints, references, family, layout):
    single, hf = references(family)
    result = run_layout(tiny_checkpoints[family], **layout)
    assert_same(result, single, hf)
    if layout.get("speculative"):
        assert result["num_draft_tokens"] > 0
    if layout.get("speculative") == "self-draft":
        assert result["num_accepted_tokens"] == result["num_draft_tokens"]


def test_gguf_blocks_split_on_block_boundaries_across_tp_ranks(tmp_path):
    """A GGUF kept in its blocks (Q4_0 linears, Q8_0 embedding and head) on tp=2: each rank holds
    whole blocks of its rows and columns (row-parallel shares of 32 and 64 inputs); the same tokens
    as one process, log-probs within the all-reduce's reordered float sums (measured 1e-7; the
    same ranks with the weights dequantized are 0.19 off)."""
    from gguf import GGMLQuantizationType as QType

    from tests.layers.test_block_quant import _tiny_gguf

    path = _tiny_gguf(tmp_path, lambda name: QType.Q8_0 if name == "token_embd.weight" else QType.Q4_0)
    single = generate(str(path), max_tokens=MAX_TOKENS, quantization="gguf")
    split = run_layout(path, tp=2, quantization="gguf")
    assert split["tokens"] == single["tokens"]
    for ours, ref in zip(split["logprobs"], single["logprobs"]):
        assert relative_error(torch.tensor(ours), torch.tensor(ref)) <= 1e-4
