"""Expert rebalancing on a running replica, printed as one JSON line: a skewed workload runs,
the per-rank expert load is measured, experts are re-placed from that load, and the same
workload runs again.

    python tests/parallel/rebalance_json.py MODEL --ep 2 --num-redundant-experts 1
"""
from __future__ import annotations

import argparse
import json
import sys

from shardserve.llm import LLM
from shardserve.request import SamplingParams

# skewed: few distinct tokens, so the router sends most tokens to a few experts
PROMPTS = [[7] * 24, [7, 8] * 12, [8] * 20, [7] * 16 + [9] * 8]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--num-redundant-experts", type=int, default=1)
    args = parser.parse_args()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM(args.model, ep_size=args.ep, tp_size=args.tp, num_redundant_experts=args.num_redundant_experts,
             show_progress=False, kv_cache_memory_bytes=1 << 22, enable_prefix_caching=False) as llm:
        before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        load_before = llm.engine.expert_load()
        llm.engine.rebalance_experts()
        after = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        load_after = llm.engine.expert_load()
    layers = sorted(load_before.processed)
    result = {
        "tokens_before": before, "tokens_after": after,
        "imbalance_before": {layer: load_before.imbalance(layer) for layer in layers},
        "imbalance_after": {layer: load_after.imbalance(layer) for layer in layers},
        "processed_before": load_before.processed, "processed_after": load_after.processed,
        "routed_before": load_before.routed,
    }
    for layer in layers:
        print(f"layer {layer}: max/mean expert load per rank {result['imbalance_before'][layer]:.3f} before "
              f"rebalancing, {result['imbalance_after'][layer]:.3f} after", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
