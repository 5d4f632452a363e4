"""Structured outputs over HTTP with the official `openai` client: OpenAI's response_format,
vLLM's structured_outputs and guided_* fields, on the embedded model, checked with jsonschema
and re."""
import asyncio
import json
import re

import jsonschema
import openai
import pytest

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 24}},
    "required": ["name", "age", "city"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Invent a person: their name, age and city, as JSON."}]


def test_json_schema_is_valid_in_50_of_50_samples_at_temperature_1(async_client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    async def one(seed: int):
        return await async_client.chat.completions.create(model="smol", messages=ASK, response_format=fmt,
                                                          temperature=1.0, seed=seed, max_tokens=160)

    async def all_of_them():
        return await asyncio.gather(*(one(seed) for seed in range(50)))

    replies = asyncio.run(all_of_them())
    for reply in replies:
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert len({r.choices[0].message.content for r in replies}) > 25  # sampled, not one answer


@pytest.mark.parametrize("body, valid", [
    ({"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"}},
     lambda text: re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", text)),
    ({"guided_choice": ["yes", "no", "maybe"]}, lambda text: text in ("yes", "no", "maybe")),
], ids=["regex", "choice"])
def test_regex_and_choice_hold_in_50_of_50_samples_at_temperature_1(async_client, body, valid):
    async def all_of_them():
        return await asyncio.gather(*(async_client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "When did it happen? Was it good?"}],
            temperature=1.0, seed=seed, max_tokens=16, extra_body=body) for seed in range(50)))

    texts = [r.choices[0].message.content for r in asyncio.run(all_of_them())]
    assert all(valid(t) for t in texts), [t for t in texts if not valid(t)]
    assert len(set(texts)) > 1


def test_stream_and_whole_agree_for_a_seeded_constrained_request(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    whole = client.chat.completions.create(model="smol", messages=ASK, response_format=fmt, temperature=1.0,
                                           seed=4, max_tokens=160)
    chunks = client.chat.completions.create(model="smol", messages=ASK, response_format=fmt, temperature=1.0,
                                            seed=4, max_tokens=160, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    jsonschema.validate(json.loads(whole.choices[0].message.content), PERSON)


def test_json_object_regex_choice_and_grammar(client):
    obj = client.chat.completions.create(model="smol", messages=ASK, response_format={"type": "json_object"},
                                         temperature=0, max_tokens=200)
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # a free-form object may be long: what came is still a JSON object's beginning
        assert obj.choices[0].message.content.startswith("{")
    date = client.completions.create(model="smol", prompt="Today's date is", max_tokens=20, temperature=1.0, seed=1,
                                     extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"}})
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", date.choices[0].text)
    question = [{"role": "user", "content": "Is Paris the capital of France?"}]
    for body in ({"structured_outputs": {"choice": ["yes", "no"]}}, {"guided_choice": ["yes", "no"]}):
        reply = client.chat.completions.create(model="smol", messages=question, max_tokens=8, temperature=1.0,
                                               seed=2, extra_body=body)
        assert reply.choices[0].message.content in ("yes", "no")
    lark = client.completions.create(model="smol", prompt="2 + 3 =", max_tokens=8, temperature=0,
                                     extra_body={"guided_grammar": 'start: " " DIGIT\nDIGIT: /[0-9]/'})
    assert re.fullmatch(r" [0-9]", lark.choices[0].text)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
])
def test_bad_constraints_are_a_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="smol", messages=ASK, max_tokens=8, extra_body=body)
    assert err.value.body["param"] == param, err.value.body
