"""A server with n-gram speculation: streamed text is the offline run's without speculation, and
vLLM's speculative decoding counters add up."""
import json

import openai

from shardserve import SamplingParams
from shardserve.llm import LLM
from tests.server_process import running_server, scrape_many

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "policy": "always"}
PROMPT = "Copy the list.\nList: apple, pear, plum, fig, lime, kiwi, date, yuzu.\nCopy: apple, pear,"


def test_streamed_text_and_speculation_metrics():
    args = dict(dtype="bfloat16", kv_cache_memory_bytes=32 << 20, max_model_len=256)
    offline = LLM("smollm2", show_progress=False, **args)
    expected = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    with running_server("--model", "smollm2", "--dtype", "bfloat16", "--kv-cache-memory", str(32 << 20),
                        "--max-model-len", "256", "--speculative-config", json.dumps(SPEC)) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        stream = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = [chunk.choices[0].text for chunk in stream if chunk.choices]
        names = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                 "vllm:generation_tokens_total")
        m = scrape_many(url, names)
    assert "".join(chunks) == expected.outputs[0].text
    drafts, draft_tokens, accepted, per_pos, generated = (m[n] for n in names)
    assert generated == 24 and 0 < accepted <= draft_tokens <= 3 * drafts and per_pos == accepted
    # a step yields one token plus the proposals that held: fewer events than tokens
    assert len(chunks) <= 24 - accepted + 1
