"""Structured outputs in the engine: the bitmask rule, the checks (a 400 naming the field), and
constrained generation on a tiny random model, whose unconstrained output is noise: whatever is
valid is the grammar's doing. Preemption and resume replay the grammar over the tokens a
request already has, so their outputs equal an uninterrupted run's."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from shardserve.config import CacheConfig, EngineConfig, SchedulerConfig
from shardserve.engine.grammar import MAX_SCHEMA_DEPTH, MAX_SPEC_BYTES, apply_token_bitmask
from shardserve.engine.launcher import build_engine
from shardserve.request import InvalidRequestError, Resume, SamplingParams, StructuredOutputs

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
JSON_SPEC = StructuredOutputs(json=json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def engine(tiny_checkpoints):
    return build_engine(EngineConfig(model=str(tiny_checkpoints["llama"]), show_progress=False,
                                     cache=CacheConfig(kv_cache_memory_bytes=1 << 22)))


def run(engine, requests: dict[str, tuple[str, SamplingParams]], resume: dict | None = None) -> dict:
    for req_id, (prompt, params) in requests.items():
        engine.add_request(req_id, prompt, params, resume=(resume or {}).get(req_id))
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.req_id] = out.outputs[0]
    return finals


def test_bitmask_keeps_exactly_the_set_bits():
    logits = torch.zeros(2, 70)
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    bitmask[0, 0] = 0b101  # tokens 0 and 2
    bitmask[0, 2] = 1 << 5  # token 69
    bitmask[1] = -1  # all (a row without a grammar)
    apply_token_bitmask(logits, bitmask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 2, 69]
    assert torch.isfinite(logits[1]).all()


@pytest.mark.parametrize("spec, param, message", [
    (StructuredOutputs(json='{"type": "objectx"}', source="response_format"), "response_format", "objectx"),
    (StructuredOutputs(regex="[a-", source="guided_regex"), "guided_regex", "regex"),
    (StructuredOutputs(grammar="start: undefined_rule", source="structured_outputs"), "structured_outputs", "unknown name"),
    (StructuredOutputs(json="[1, 2]", source="guided_json"), "guided_json", "object"),
    (StructuredOutputs(regex="a" * (MAX_SPEC_BYTES + 1), source="guided_regex"), "guided_regex", "bytes"),
    (StructuredOutputs(json=json.dumps(
        {"type": "array", "items": json.loads('{"type": "array", "items": ' * MAX_SCHEMA_DEPTH + "{}" + "}" * MAX_SCHEMA_DEPTH)}),
        source="response_format"), "response_format", "nests deeper"),
])
def test_bad_specs_are_refused_naming_their_field(engine, spec, param, message):
    with pytest.raises(InvalidRequestError, match=message) as err:
        engine.add_request("bad", "hi", SamplingParams(structured_outputs=spec))
    assert err.value.param == param
    assert not engine.has_unfinished_requests()


def test_a_spec_names_exactly_one_constraint():
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputs(regex="a", choice=("b",))
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputs()


def test_random_weights_write_schema_valid_json_at_temperature_1(engine):
    params = {f"s{i}": ("Describe someone:", SamplingParams(max_tokens=80, temperature=1.0, seed=i,
                                                            structured_outputs=JSON_SPEC)) for i in range(12)}
    unconstrained = run(engine, {"u": ("Describe someone:", SamplingParams(max_tokens=40, temperature=1.0, seed=0))})
    with pytest.raises(ValueError):  # the model alone writes no JSON
        json.loads(unconstrained["u"].text)
    for out in run(engine, params).values():
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_regex_choice_grammar_and_json_object(engine):
    specs = {
        "regex": StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2,4}"),
        "choice": StructuredOutputs(choice=("red", "green", "blue")),
        "lark": StructuredOutputs(grammar='start: "x=" NUM ";"\nNUM: /[0-9]{1,3}/'),
        "gbnf": StructuredOutputs(grammar='root ::= "ok" | "no"'),
        "json_object": StructuredOutputs(json_object=True),
    }
    outs = run(engine, {k: ("Answer:", SamplingParams(max_tokens=60, temperature=1.0, seed=3, structured_outputs=s))
                        for k, s in specs.items()})
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", outs["regex"].text)
    assert outs["choice"].text in ("red", "green", "blue")
    assert re.fullmatch(r"x=[0-9]{1,3};", outs["lark"].text)
    assert outs["gbnf"].text in ("ok", "no")
    if outs["json_object"].finish_reason == "stop":  # a free-form object may run to max_tokens
        assert isinstance(json.loads(outs["json_object"].text), dict)
    assert all(o.finish_reason == "stop" for k, o in outs.items() if k != "json_object")


def test_constrained_and_free_requests_share_a_batch_unchanged(engine):
    free = SamplingParams(max_tokens=16, temperature=0.8, seed=5, ignore_eos=True)
    alone = run(engine, {"free": ("The quick brown fox", free)})["free"]
    mixed = run(engine, {"free": ("The quick brown fox", free),
                         "json": ("Describe someone:", SamplingParams(max_tokens=60, seed=1, structured_outputs=JSON_SPEC))})
    assert mixed["free"].token_ids == alone.token_ids
    jsonschema.validate(json.loads(mixed["json"].text), SCHEMA)


def test_resume_replays_the_grammar_over_delivered_tokens(engine):
    params = SamplingParams(max_tokens=80, temperature=1.0, seed=11, structured_outputs=JSON_SPEC)
    full = run(engine, {"full": ("Describe someone:", params)})["full"]
    for cut in (1, len(full.token_ids) // 2, len(full.token_ids) - 1):
        resumed = run(engine, {"r": ("Describe someone:", params)}, {"r": Resume(tuple(full.token_ids[:cut]))})["r"]
        assert resumed.token_ids == full.token_ids and resumed.text == full.text


def test_resume_tokens_outside_the_grammar_are_refused(engine):
    tokens = tuple(engine.tokenizer.encode("hello", add_special_tokens=False))
    with pytest.raises(InvalidRequestError, match="do not follow") as err:
        engine.add_request("r", "hi", SamplingParams(max_tokens=40, structured_outputs=JSON_SPEC), resume=Resume(tokens))
    assert err.value.param == "resume_token_ids"


def test_preempted_constrained_requests_resume_their_grammar(engine, tiny_checkpoints):
    """A KV cache too small for all of them at once: requests are preempted and recomputed, and
    each one's output equals its run alone."""
    block_bytes = (1 << 22) // engine.runner.kv_cache.num_blocks
    tight = build_engine(EngineConfig(model=str(tiny_checkpoints["llama"]), show_progress=False, max_model_len=128,
                                      cache=CacheConfig(kv_cache_memory_bytes=12 * block_bytes,
                                                        enable_prefix_caching=False),
                                      scheduler=SchedulerConfig(max_num_seqs=8)))
    params = {f"p{i}": ("Describe someone:", SamplingParams(max_tokens=80, temperature=1.0, seed=20 + i,
                                                            structured_outputs=JSON_SPEC)) for i in range(6)}
    together = run(tight, params)
    assert tight.scheduler.num_preemptions > 0
    for req_id, item in params.items():
        alone = run(tight, {req_id: item})[req_id]
        assert together[req_id].token_ids == alone.token_ids
