"""Accuracy of `--quantization gguf`: perplexity of SmolLM2-135M-Instruct in Q4_0, Q4_1 and Q8_0 against
llama.cpp's `llama-perplexity` on the same files, and greedy agreement with bfloat16.

Perplexity is computed as llama-perplexity computes it: the text tokenized whole (no BOS: the
file's `add_bos_token` is false), cut into chunks of `--ctx` tokens, each chunk one prefill, and
the second half of each chunk scored (each token's negative log-likelihood given the tokens before
it in its chunk); PPL = exp(mean). The text is Python's own documentation topics
(`pydoc_data.topics`, in the standard library, so every machine has the same bytes for a given
Python; its hash is printed), the first `--chunks` chunks of it. The bfloat16 row serves the Q4_1
file dequantized (its exact values) in bfloat16; llama.cpp's row for it runs the F32 dequantization.

Greedy agreement: 32 prompts (chat-templated questions), 32 greedy tokens each, in each format
against bfloat16 (the dequantized Q4_1 file): how many of the 32 continuations are identical, and
the mean number of leading tokens that agree.

Run: .venv/bin/python benchmarks/quantized_accuracy.py [--llama-bin-dir DIR] [--chunks 16]
Last line: RESULT {"q4_0_ppl", "q4_0_ppl_llama_cpp", "q4_0_ppl_ratio", ..., "q4_0_greedy_identical", ...}
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from quantized_decode import FORMATS
from serving_levels import smollm2_gguf
from shardserve.engine.interface import ScheduledSeq
from shardserve.engine.sampler import SamplingState
from shardserve.llm import LLM
from shardserve.request import Request, SamplingParams

RESULTS = Path(__file__).parent / "results"
QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "How many legs does a spider have?",
    "What does a thermometer measure?", "Write one sentence about the ocean.", "What is 12 times 12?",
    "Who wrote Romeo and Juliet?", "What is photosynthesis?", "Give me a synonym for happy.",
    "What planet is closest to the sun?", "Why is the sky blue?", "What is the boiling point of water?",
    "Describe a cat in five words.", "What language is spoken in Brazil?", "How do bees make honey?",
    "What is the largest ocean?", "Explain gravity to a child.", "What is a prime number?",
    "Translate 'good morning' into Spanish.", "What is the opposite of cold?", "List two uses of copper.",
    "What causes rain?", "Who painted the Mona Lisa?", "What is the square root of 81?",
    "Write a short greeting for a letter.", "What do plants need to grow?", "What is an atom?",
    "How many days are in a leap year?", "What is the main ingredient of bread?", "Name a mammal that can fly.",
    "What is the freezing point of water in Fahrenheit?", "Suggest a name for a pet dog.",
]


def fixed_text() -> tuple[str, str]:
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    return text, hashlib.sha256(text.encode()).hexdigest()[:16]


def chunk_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    """log-softmax of the logits at every position of `ids`, one prefill [len(ids), vocab]."""
    engine = llm.engine
    runner = engine.runner
    req = Request("perplexity", list(ids), SamplingParams(), seed=0)
    engine.block_manager.allocate(req, len(ids))
    runner.states[req.req_id] = SamplingState(SamplingParams(), 0, list(ids), len(ids))
    try:
        with torch.inference_mode():
            inputs = runner.prepare_inputs([ScheduledSeq(req.req_id, 0, len(ids), req.block_ids, False)])
            return torch.log_softmax(runner.model.compute_logits(runner.forward(inputs)).float(), dim=-1)
    finally:
        engine.block_manager.free_request(req)
        del runner.states[req.req_id]


def our_perplexity(llm: LLM, tokens: list[int], ctx: int, chunks: int) -> float:
    nll, count = 0.0, 0
    first = ctx // 2
    for c in range(chunks):
        ids = tokens[c * ctx:(c + 1) * ctx]
        logprobs = chunk_logprobs(llm, ids)
        targets = torch.tensor(ids[first + 1:])
        nll -= float(logprobs[first:ctx - 1].gather(1, targets[:, None]).sum())
        count += len(targets)
    return math.exp(nll / count)


def llama_perplexity(bin_dir: Path, gguf: Path, text_file: Path, ctx: int, chunks: int) -> tuple[float, int]:
    out = subprocess.run([str(bin_dir / "llama-perplexity"), "-m", str(gguf), "-f", str(text_file), "-c", str(ctx),
                          "-b", str(ctx), "--chunks", str(chunks), "-t", "2"], capture_output=True, text=True, check=True)
    log = out.stdout + out.stderr
    ppl = re.search(r"Final estimate: PPL = ([0-9.]+)", log)
    tokens = re.search(r"tokenizing the input .*?\n.*?(\d+) tokens", log, re.S) or re.search(r"n_tokens\s*=\s*(\d+)", log)
    if ppl is None:
        raise RuntimeError(f"llama-perplexity printed no estimate:\n{log[-2000:]}")
    return float(ppl.group(1)), int(tokens.group(1)) if tokens else -1


def greedy(llm: LLM) -> list[list[int]]:
    tokenizer = llm.engine.tokenizer
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in QUESTIONS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


def agreement(ours: list[list[int]], reference: list[list[int]]) -> tuple[int, float]:
    identical = sum(a == b for a, b in zip(ours, reference))
    prefixes = []
    for a, b in zip(ours, reference):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefixes.append(n)
    return identical, sum(prefixes) / len(prefixes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-bin-dir", type=Path, default=Path(os.environ.get("LLAMA_BIN_DIR", "../llamacpp/build/bin")))
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "shardserve-bench")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=16)
    args = parser.parse_args()
    text, digest = fixed_text()
    text_file = args.cache_dir / f"perplexity_{digest}.txt"
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    text_file.write_text(text)
    kwargs = dict(show_progress=False, kv_cache_memory_bytes=64 << 20, max_model_len=args.ctx)
    result: dict = {"text_sha256_16": digest, "ctx": args.ctx, "chunks": args.chunks}

    bf16 = LLM(str(smollm2_gguf("Q4_1", args.llama_bin_dir, args.cache_dir)), dtype="bfloat16", quantization="none", **kwargs)
    tokens = bf16.engine.tokenizer.encode(text)
    if len(tokens) < args.ctx * args.chunks:
        sys.exit(f"the text has {len(tokens)} tokens, fewer than {args.chunks} chunks of {args.ctx}")
    reference = greedy(bf16)
    result["bf16_ppl"] = our_perplexity(bf16, tokens, args.ctx, args.chunks)
    f32 = smollm2_gguf("F32", args.llama_bin_dir, args.cache_dir)
    result["f32_ppl_llama_cpp"], _ = llama_perplexity(args.llama_bin_dir, f32, text_file, args.ctx, args.chunks)
    print(f"bf16 (dequantized Q4_1): ours {result['bf16_ppl']:.4f}; llama.cpp F32 {result['f32_ppl_llama_cpp']:.4f}", flush=True)
    del bf16

    for fmt in args.formats.split(","):
        gguf = smollm2_gguf(fmt, args.llama_bin_dir, args.cache_dir)
        llm = LLM(str(gguf), quantization="gguf", **kwargs)
        key = fmt.lower()
        ours = our_perplexity(llm, tokens, args.ctx, args.chunks)
        theirs, _ = llama_perplexity(args.llama_bin_dir, gguf, text_file, args.ctx, args.chunks)
        identical, prefix = agreement(greedy(llm), reference)
        result.update({f"{key}_ppl": ours, f"{key}_ppl_llama_cpp": theirs, f"{key}_ppl_ratio": ours / theirs,
                       f"{key}_greedy_identical": identical, f"{key}_greedy_prefix": prefix})
        print(f"{fmt}: PPL ours {ours:.4f}, llama.cpp {theirs:.4f} (ratio {ours / theirs:.4f}); greedy vs bf16: "
              f"{identical}/32 identical, mean agreeing prefix {prefix:.1f} of 32 tokens", flush=True)
        del llm
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "quantized_accuracy.json").write_text(json.dumps(result, indent=2))
    print("RESULT " + json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
