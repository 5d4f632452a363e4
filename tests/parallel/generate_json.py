"""Run greedy generation on a (possibly parallel) replica and print one JSON line:
{"tokens": [[...] per prompt], "logprobs": [[[vocab floats] per generated token] per prompt],
"greedy_tokens": with pp > 1 and tp=1, the same prompts again without logprobs (the last stage's
argmax), otherwise "tokens" again}.

Used by the multi-rank tests as a subprocess, so that every rank is a fresh process (and, for
the single-process baseline, in-process through `generate`):
    python tests/parallel/generate_json.py MODEL --tp 2 --pp 1 --ep 1 --max-tokens 6 [--speculative ngram|self-draft]
        [--quantization gguf]
"""
from __future__ import annotations

import argparse
import json

from shardserve.llm import LLM
from shardserve.request import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [3, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]]
# speculation on every step that has proposals: n-gram lookup (a 1-gram match suffices), or the
# target model as its own draft (every guess holds)
SPECULATIVE = {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "policy": "always"},
               "self-draft": {"num_speculative_tokens": 3, "policy": "always"}}


def generate(model: str, tp: int = 1, pp: int = 1, ep: int = 1, num_micro_batches: int | None = None,
             max_tokens: int = 6, speculative: str | None = None, quantization: str | None = None) -> dict:
    spec = {"model": model, **SPECULATIVE[speculative]} if speculative == "self-draft" else SPECULATIVE.get(speculative)
    # a GGUF written by the tests carries no tokenizer: prompts and outputs are token ids anyway
    with LLM(model, tp_size=tp, pp_size=pp, ep_size=ep, num_micro_batches=num_micro_batches,
             show_progress=False, kv_cache_memory_bytes=1 << 22, speculative_config=spec, quantization=quantization,
             skip_tokenizer_init=model.endswith(".gguf")) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=-1))
        stats = llm.engine.speculator.stats if spec else None
        # without logprobs a pipeline's last stage (tp=1) takes its LM head's argmax and sends the
        # tokens back, never writing the logits (one process: tests/engine/test_engine.py)
        greedy = outs if tp > 1 or pp == 1 else llm.generate(PROMPTS, SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True))
    result = {"tokens": [], "logprobs": [], "greedy_tokens": [o.outputs[0].token_ids for o in greedy],
              "num_draft_tokens": stats.num_draft_tokens if stats else 0,
              "num_accepted_tokens": stats.num_accepted_tokens if stats else 0}
    for out in outs:
        completion = out.outputs[0]
        result["tokens"].append(completion.token_ids)
        rows = []
        for step in completion.logprobs:
            row = [0.0] * len(step.top)
            for token_id, value in step.top:
                row[token_id] = value
            rows.append(row)
        result["logprobs"].append(rows)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    for size in ("--tp", "--pp", "--ep"):
        parser.add_argument(size, type=int, default=1)
    parser.add_argument("--num-micro-batches", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=6)
    parser.add_argument("--speculative", choices=tuple(SPECULATIVE), default=None)
    parser.add_argument("--quantization", default=None)
    args = parser.parse_args()
    print(json.dumps(generate(args.model, args.tp, args.pp, args.ep, args.num_micro_batches, args.max_tokens,
                              args.speculative, args.quantization)))


if __name__ == "__main__":
    main()
