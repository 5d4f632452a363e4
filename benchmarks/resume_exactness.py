"""Resume exactness in bfloat16: what the router's failover promises, measured on the embedded model
served as `make serve` does.

32 prompts (16 chat conversations, 16 random token prompts of 8-300 tokens) generate 104 tokens
together, greedy and seeded. Each is then re-run from its prompt plus its first k tokens (k = 1, 16,
100), as a replica that takes over a stream recomputes it; the continuation must be the
uninterrupted run's tokens. Two ways of recomputing the prefix: the prompt's blocks from the prefix
cache, and chunked prefill (no prefix cache, at most 64 tokens a step).

Run
    .venv/bin/python benchmarks/resume_exactness.py
    The last line is `RESULT {"identical": {mode: {sampling: {k: n of 32}}}, "all_identical", ...}`,
    also saved as benchmarks/results/resume_exactness.json. Target: 32 of 32 everywhere.
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

from shardserve import SamplingParams
from shardserve.llm import LLM

RESULTS = Path(__file__).parent / "results"
NUM_TOKENS, CUTS = 104, (1, 16, 100)
MODES = {"prefix_cache": dict(enable_prefix_caching=True),
         "chunked_prefill": dict(enable_prefix_caching=False, max_num_batched_tokens=64)}
SAMPLINGS = {"greedy": dict(temperature=0), "seeded": dict(temperature=0.9, top_p=0.95, seed=11)}
TOPICS = ["the sea", "a CPU cache", "copper", "bread", "rivers", "the moon", "chess", "volcanoes", "bees",
          "glass", "trains", "winter", "maps", "salt", "clocks", "bridges"]


def prompts(llm: LLM) -> list[list[int]]:
    tokenizer, rng = llm.tokenizer, random.Random(0)
    chats = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": f"Tell me about {topic}."}],
                                                            add_generation_prompt=True, tokenize=False))
             for topic in TOPICS]
    randoms = [[rng.randrange(100, 40000) for _ in range(rng.randrange(8, 301))] for _ in range(16)]
    return chats + randoms


def main() -> None:
    identical: dict = {}
    start = time.perf_counter()
    for mode, settings in MODES.items():
        llm = LLM("smollm2", dtype="bfloat16", quantization="none", kv_cache_memory_bytes=256 << 20, max_model_len=1024,
                  show_progress=False, **settings)
        batch = prompts(llm)
        identical[mode] = {}
        for name, sampling in SAMPLINGS.items():
            params = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, **sampling)
            full = [out.outputs[0].token_ids for out in llm.generate(batch, params)]
            identical[mode][name] = {}
            for k in CUTS:
                rest = SamplingParams(max_tokens=NUM_TOKENS - k, ignore_eos=True, **sampling)
                resumed = llm.generate([p + f[:k] for p, f in zip(batch, full)], rest)
                same = sum(out.outputs[0].token_ids == f[k:] for out, f in zip(resumed, full))
                identical[mode][name][k] = same
                print(f"[{time.perf_counter() - start:5.0f} s] {mode:15s} {name:6s} k={k:3d}: "
                      f"{same} of {len(batch)} identical", flush=True)
        llm.shutdown()
    summary = {"identical": identical, "prompts": 32, "tokens": NUM_TOKENS, "dtype": "bfloat16",
               "all_identical": all(n == 32 for m in identical.values() for s in m.values() for n in s.values())}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "resume_exactness.json").write_text(json.dumps(summary, indent=1))
    print("RESULT " + json.dumps(summary))


if __name__ == "__main__":
    main()
