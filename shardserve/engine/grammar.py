"""Structured outputs: the grammar a request's StructuredOutputs compiles to, and the token masks
that keep its sampled tokens inside it, on llguidance.

Why llguidance (benchmarks/grammar_mask_cost.py, SmolLM2's 49k vocabulary, this CPU): a mask
costs it 19-105 us a token (mean 41), xgrammar 5-22 us (mean 15), against a decode step of
20-80 ms: either is under 1% of a step at 32 sequences. llguidance needs no other package,
where xgrammar pulls in triton and transformers, and it compiles a schema in about 1 ms (xgrammar
4-8 ms). The masks of a step are computed in one parallel call in the sampler, not overlapped
with the forward pass: a whole batch's costs 0.03-0.06 ms (8-32 sequences), less than handing
it to a thread that then waits for the GIL (benchmarks/constrained_throughput.py: constrained
serving runs at 0.95-0.98x unconstrained).

One `Grammars` per process, built with the model's tokenizer: it checks specs (the validator
calls it, so a bad schema is a 400), caches compiled grammar text per spec, and builds matchers.
A matcher is made for a sequence the first time it is sampled and replays the tokens it already
has, so a preempted request (its state rebuilt) and a request resumed from another replica
(`Resume`) continue exactly where their grammar was.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict

import torch

from shardserve.request import InvalidRequestError, StructuredOutputs

# Written like json.dumps by default; no free whitespace, so a model cannot run out its token
# budget on newlines (an unbounded-whitespace grammar is the collapse vLLM's users report).
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_SPEC_BYTES = 64 * 1024  # a schema, regex or grammar; each one is parsed on the request path
MAX_SCHEMA_DEPTH = 32  # nested objects and arrays in a JSON schema
CACHE_SIZE = 256  # compiled specs kept per process


def grammar_text(spec: StructuredOutputs) -> str:
    """llguidance's grammar for `spec` (not yet checked)."""
    import llguidance

    matcher = llguidance.LLMatcher
    if spec.json is not None:
        return matcher.grammar_from_json_schema(spec.json, defaults=JSON_FORMAT)
    if spec.json_object:
        return matcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_FORMAT)
    if spec.regex is not None:
        return matcher.grammar_from_regex(spec.regex)
    if spec.choice:
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    grammar = spec.grammar or ""
    if "::=" in grammar:  # GBNF (llama.cpp's, and what xgrammar's users send); llguidance reads Lark
        from llguidance.gbnf_to_lark import gbnf_to_lark
        grammar = gbnf_to_lark(grammar)
    return matcher.grammar_from_lark(grammar)


def check_limits(spec: StructuredOutputs) -> None:
    """Size and nesting limits, before anything is parsed by the grammar compiler."""
    param = spec.param
    text = spec.json if spec.json is not None else spec.regex if spec.regex is not None else spec.grammar
    size = len((text or "").encode()) + sum(len(c.encode()) for c in spec.choice)
    if size > MAX_SPEC_BYTES:
        raise InvalidRequestError(f"{param} is {size} bytes; at most {MAX_SPEC_BYTES} are accepted", param)
    if spec.json is not None:
        try:
            schema = json.loads(spec.json)
        except (ValueError, RecursionError) as exc:
            raise InvalidRequestError(f"{param}: the JSON schema is not valid JSON ({exc})", param) from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError(f"{param}: a JSON schema is an object", param)
        if _depth(schema) > MAX_SCHEMA_DEPTH:
            raise InvalidRequestError(f"{param}: the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels", param)


def _depth(value, level: int = 0) -> int:
    # stops descending once past the limit, so a hostile document costs little
    if level > MAX_SCHEMA_DEPTH:
        return level
    if isinstance(value, dict):
        return max((_depth(v, level + 1) for v in value.values()), default=level)
    if isinstance(value, list):
        return max((_depth(v, level + 1) for v in value), default=level)
    return level


class Grammars:
    """This process's grammar compiler and matcher factory for one model's vocabulary."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's vocabulary)
        self.eos_token_ids = eos_token_ids
        self._llg_tokenizer = None
        self._executor = None
        self._compiled: OrderedDict[StructuredOutputs, str] = OrderedDict()
        self._lock = threading.Lock()  # the HTTP handlers' checks and the engine's step share the cache

    def _llguidance_tokenizer(self):
        # built on first use (0.2-0.3 s): a replica that never sees a constrained request never pays
        with self._lock:
            if self._llg_tokenizer is None:
                import llguidance
                self._llg_tokenizer = llguidance.LLTokenizer(self._tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                             eos_token=list(self.eos_token_ids))
            return self._llg_tokenizer

    def compile(self, spec: StructuredOutputs) -> str:
        """The checked grammar of `spec`; InvalidRequestError (naming the field) if it is not one."""
        with self._lock:
            cached = self._compiled.get(spec)
            if cached is not None:
                self._compiled.move_to_end(spec)
                return cached
        import llguidance

        check_limits(spec)
        try:
            text = grammar_text(spec)
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"{spec.param}: {exc}", spec.param) from None
        error = llguidance.LLMatcher.validate_grammar(text, self._llguidance_tokenizer())
        if error:
            raise InvalidRequestError(f"{spec.param}: {error.strip().splitlines()[0]}", spec.param)
        with self._lock:
            self._compiled[spec] = text
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return text

    def matcher(self, spec: StructuredOutputs, output_token_ids: list[int]):
        """A matcher for `spec` that has consumed `output_token_ids`."""
        import llguidance

        matcher = llguidance.LLMatcher(self._llguidance_tokenizer(), self.compile(spec), log_level=0)
        if output_token_ids:
            matcher.consume_tokens(output_token_ids)
        return matcher

    def check_tokens(self, spec: StructuredOutputs, output_token_ids: list[int]) -> None:
        """InvalidRequestError unless `output_token_ids` follow `spec` from its start (a resume)."""
        matcher = self.matcher(spec, [])
        if matcher.validate_tokens(output_token_ids) < len(output_token_ids):
            raise InvalidRequestError("resume_token_ids do not follow the request's structured output",
                                      "resume_token_ids")

    def fill_masks(self, matchers: list, rows: list[int], bitmask: torch.Tensor) -> None:
        """Each matcher's next-token mask into its row of `bitmask` ([N, words] int32, contiguous),
        in one call that computes them in parallel outside the GIL. (Not llguidance.torch's
        wrapper: importing it costs 2 s of torch.compile set-up for a pointer and a size.)"""
        import llguidance

        if self._executor is None:
            self._executor = llguidance.LLExecutor(torch.get_num_threads())
        assert bitmask.dtype == torch.int32 and bitmask.is_contiguous() and bitmask.device.type == "cpu"
        self._executor.unsafe_compute_mask_ptr(list(zip(matchers, rows)), bitmask.data_ptr(),
                                               bitmask.shape[1] * 4, bitmask.shape[0])


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


_BIT = torch.arange(32, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, every logit whose bit is 0 in its row's mask (bit j of word w is
    token 32w + j, llguidance's and xgrammar's layout)."""
    bitmask = bitmask.to(logits.device, non_blocking=True)  # llguidance fills host memory
    allowed = ((bitmask.unsqueeze(-1) >> _BIT.to(logits.device)) & 1).flatten(1)[:, : logits.shape[-1]].bool()
    logits.masked_fill_(~allowed, float("-inf"))
