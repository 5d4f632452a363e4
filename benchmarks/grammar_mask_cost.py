"""Grammar engines on this CPU: xgrammar vs llguidance, per-token mask cost on the embedded
model's vocabulary (SmolLM2, 49,152 tokens).

Why: structured outputs compute one token mask per constrained sequence per decode step, on the
CPU, between two forward passes. Its cost has to stay well under a decode step (~20 ms for
SmolLM2 on 2 cores), or constrained throughput collapses.

What is timed, for each engine and each JSON schema below:
    compile   the schema -> grammar compile and a first matcher (cold: what a server pays once
              per schema; llguidance builds lazily, so part of its cost moves to the first masks)
    mask      one next-token mask (bitmask over the vocab) + advancing by the chosen token
Two token paths per schema: `document` (a valid instance, tokenized the way the model would write
it) and `walk` (tokens drawn at random among the allowed ones, seeded: strings, numbers and
whitespace the document path never visits), each at most 96 tokens.

Run
    .venv/bin/python benchmarks/grammar_mask_cost.py [--walks N]
    Prints a table, then `RESULT {"xgrammar": {...}, "llguidance": {...}, "mask_us_ratio"}`
    (also benchmarks/results/grammar_mask_cost.json); mask_us_ratio is llguidance's mean mask
    time over xgrammar's (below 1: llguidance is faster). xgrammar is not a dependency of
    shardserve: install it (`pip install --no-deps xgrammar apache-tvm-ffi`) to compare.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from shardserve.models.checkpoint import load_checkpoint
from shardserve.models.tokenizer import load_tokenizer

RESULTS = Path(__file__).parent / "results"
MAX_TOKENS = 96

SCHEMAS = {
    "flat": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                 "city": {"type": "string"}},
              "required": ["name", "age", "city"], "additionalProperties": False},
             {"name": "Ada Lovelace", "age": 36, "city": "London"}),
    "nested": ({"type": "object", "properties": {
                    "order_id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
                    "items": {"type": "array", "items": {"type": "object", "properties": {
                        "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
                        "price": {"type": "number"}}, "required": ["sku", "qty", "price"],
                        "additionalProperties": False}, "minItems": 1},
                    "status": {"enum": ["open", "paid", "shipped"]}},
                "required": ["order_id", "items", "status"], "additionalProperties": False},
               {"order_id": "AB-1234", "items": [{"sku": "pen", "qty": 2, "price": 1.5},
                                                 {"sku": "ink", "qty": 1, "price": 4.25}], "status": "paid"}),
    "free_json": ({"type": "object"}, {"answer": "Paris", "confidence": 0.9, "sources": ["atlas"]}),
}


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer) -> None:
        import llguidance
        import llguidance.torch
        self.llg, self.llg_torch = llguidance, llguidance.torch
        self.tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), eos_token=list(tokenizer.eos_token_ids))
        self.vocab = self.tokenizer.vocab_size

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        self.llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        return grammar

    def matcher(self, grammar):
        return self.llg.LLMatcher(self.tokenizer, grammar)

    def fill(self, matcher, bitmask: torch.Tensor) -> None:
        self.llg_torch.fill_next_token_bitmask(matcher, bitmask, 0)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_stopped() or matcher.is_accepting()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer) -> None:
        import xgrammar
        self.xgr = xgrammar
        vocab = [tokenizer.id_to_token(i) or "" for i in range(tokenizer.vocab_size)]
        info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.BYTE_LEVEL,
                                      stop_token_ids=list(tokenizer.eos_token_ids))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.vocab = len(vocab)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, grammar):
        return self.xgr.GrammarMatcher(grammar)

    def fill(self, matcher, bitmask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_terminated()


def allowed_ids(bitmask: torch.Tensor, vocab: int) -> list[int]:
    bits = (bitmask[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].nonzero().flatten().tolist()


def run_path(engine, grammar, tokens: list[int] | None, rng: random.Random | None) -> list[float]:
    """Mask + advance times (microseconds), along `tokens` or a random walk when tokens is None."""
    matcher = engine.matcher(grammar)
    bitmask = torch.full((1, (engine.vocab + 31) // 32), -1, dtype=torch.int32)
    times = []
    for step in range(MAX_TOKENS if tokens is None else len(tokens)):
        start = time.perf_counter()
        engine.fill(matcher, bitmask)
        if tokens is None:
            pause = time.perf_counter()
            token = rng.choice(allowed_ids(bitmask, engine.vocab))
            resume = time.perf_counter()
        else:
            token, pause, resume = tokens[step], 0.0, 0.0
        ok = engine.accept(matcher, token)
        times.append((time.perf_counter() - start - (resume - pause)) * 1e6)
        if not ok or engine.done(matcher):
            break
    return times


def measure(engine, tokenizer, walks: int) -> dict:
    report = {}
    for name, (schema, instance) in SCHEMAS.items():
        start = time.perf_counter()
        grammar = engine.compile(schema)
        engine.matcher(grammar)
        compile_ms = (time.perf_counter() - start) * 1e3
        document = tokenizer.encode(json.dumps(instance, separators=(", ", ": ")), add_special_tokens=False)
        doc_us = run_path(engine, grammar, document, None)
        rng = random.Random(0)
        walk_us = [t for _ in range(walks) for t in run_path(engine, grammar, None, rng)]
        report[name] = {"compile_ms": round(compile_ms, 1), "document_tokens": len(doc_us),
                        "document_mask_us_mean": round(statistics.fmean(doc_us), 1),
                        "walk_mask_us_mean": round(statistics.fmean(walk_us), 1),
                        "walk_mask_us_p99": round(sorted(walk_us)[int(0.99 * (len(walk_us) - 1))], 1)}
        print(f"{engine.name:10s} {name:9s} compile {compile_ms:8.1f} ms  document ({len(doc_us)}/{len(document)} tokens) {report[name]['document_mask_us_mean']:8.1f} us/token"
              f"  walk {report[name]['walk_mask_us_mean']:8.1f} us/token (p99 {report[name]['walk_mask_us_p99']:.1f})", flush=True)
    all_means = [r[k] for r in report.values() for k in ("document_mask_us_mean", "walk_mask_us_mean")]
    report["mask_us_mean"] = round(statistics.fmean(all_means), 1)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--walks", type=int, default=5, help="random walks per schema")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(load_checkpoint(None))
    summary = {}
    for factory in (Llguidance, Xgrammar):
        try:
            start = time.perf_counter()
            engine = factory(tokenizer)
            setup_s = time.perf_counter() - start
        except ImportError as e:
            print(f"{factory.name}: not installed ({e})")
            continue
        print(f"{factory.name}: tokenizer set-up {setup_s:.2f} s", flush=True)
        summary[factory.name] = {"setup_s": round(setup_s, 2), **measure(engine, tokenizer, args.walks)}
    if len(summary) == 2:
        summary["mask_us_ratio"] = round(summary["llguidance"]["mask_us_mean"] / summary["xgrammar"]["mask_us_mean"], 3)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "grammar_mask_cost.json").write_text(json.dumps(summary, indent=1))
    print("RESULT " + json.dumps(summary))


if __name__ == "__main__":
    main()
