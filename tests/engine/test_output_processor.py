"""The output processor: deltas per step, the whole completion once at the end, and work that
grows linearly with a stream's length (counted, not timed)."""
from shardserve.engine.interface import SampledToken
from shardserve.engine.output_processor import OutputProcessor
from shardserve.models.checkpoint import load_checkpoint
from shardserve.models.tokenizer import load_tokenizer
from shardserve.request import FinishReason, Request, RequestStatus, SamplingParams


class CountingTokenizer:
    """Wraps a tokenizer and counts what decoding costs: calls, and token ids decoded in all."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.num_calls = 0
        self.num_ids_decoded = 0

    def decode(self, ids, skip_special_tokens=True):
        self.num_calls += 1
        self.num_ids_decoded += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def stream(tokenizer, token_ids: list[int], params: SamplingParams):
    """Feed `token_ids` one step each, as the engine does; (step outputs, the final one)."""
    processor = OutputProcessor(tokenizer)
    req = Request("r", [1, 2, 3], params, seed=0)
    req.status = RequestStatus.RUNNING
    processor.add(req, "prompt")
    outputs = []

    def stop(req_id, stop_string):
        req.status, req.finish_reason, req.stop_reason = RequestStatus.FINISHED, FinishReason.STOP, stop_string

    for i, token_id in enumerate(token_ids):
        req.output_token_ids.append(token_id)
        if i == len(token_ids) - 1 and not req.is_finished:
            req.status, req.finish_reason = RequestStatus.FINISHED, FinishReason.LENGTH
        outputs += processor.process([req], {"r": [SampledToken(token_id, -0.5, [])]}, stop)
        if req.is_finished:
            break
    return outputs, outputs[-1]


TOKENIZER = load_tokenizer(load_checkpoint("smollm2"))
TEXT_IDS = TOKENIZER.encode(" The quick brown fox jumps over the lazy dog, naïve café 東京. " * 100)[:2000]


def test_a_2000_token_stream_costs_linear_work():
    counting = CountingTokenizer(TOKENIZER)
    outputs, final = stream(counting, TEXT_IDS, SamplingParams(max_tokens=4000, stop=("never appears",), logprobs=0))
    n = len(TEXT_IDS)
    assert n == 2000 and len(outputs) == n and final.finished
    # decoding: two bounded windows per token (a quadratic detokenizer decodes ~n^2 / 2 ids)
    assert counting.num_calls <= 2 * n
    assert counting.num_ids_decoded <= 16 * n
    # outputs: each step carries its delta only; the whole completion comes once, at the end
    assert sum(len(o.new_token_ids) for o in outputs) == n
    assert all(not o.outputs for o in outputs[:-1])
    assert final.outputs[0].token_ids == TEXT_IDS and len(final.outputs[0].logprobs) == n
    assert sum(len(o.new_logprobs) for o in outputs) == n
    assert "".join(o.new_text for o in outputs) == final.outputs[0].text == TOKENIZER.decode(TEXT_IDS)


def test_stop_string_cuts_the_stream_and_the_final_text():
    ids = TOKENIZER.encode(" one two THE END three four")
    outputs, final = stream(TOKENIZER, ids, SamplingParams(stop=("THE END",)))
    assert final.outputs[0].text == "".join(o.new_text for o in outputs) == " one two "
    assert final.outputs[0].stop_reason == "THE END" and final.outputs[0].finish_reason == "stop"


def test_whole_output_on_demand_hands_out_nothing_new():
    processor = OutputProcessor(TOKENIZER)
    req = Request("r", [1, 2], SamplingParams(), seed=0)
    processor.add(req, None)
    ids = TOKENIZER.encode(" hello world")
    for token_id in ids:
        req.output_token_ids.append(token_id)
        streamed = processor.process([req], {"r": [SampledToken(token_id)]}, lambda *_: None)[0].new_text
    whole = processor.output(req)
    assert whole.outputs[0].token_ids == ids and whole.outputs[0].text.endswith(streamed)
    assert whole.new_text == "" and not whole.finished
