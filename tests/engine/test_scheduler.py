"""Scheduler policies on a pure-Python loop (no model): fake sampled tokens."""
from shardserve.config import SchedulerConfig
from shardserve.engine.block_manager import BlockManager
from shardserve.engine.interface import ModelRunnerOutput, SampledToken
from shardserve.engine.scheduler import Scheduler
from shardserve.request import FinishReason, Request, SamplingParams


def make(num_blocks=64, block_size=4, **cfg) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, block_size), max_model_len=64)


def req(rid, n_prompt, max_tokens=4, priority=0, first=1, **kw) -> Request:
    prompt = list(range(first, first + n_prompt))
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **kw), seed=0, priority=priority)


def step(s: Scheduler, token: int = 7):
    out = s.schedule()
    result = ModelRunnerOutput({q.req_id: SampledToken(token) for q in out.seqs if q.sample})
    s.update(out, result)
    return out


def test_token_budget_chunks_long_prompts_and_mixes_decodes():
    s = make(max_num_batched_tokens=8)
    s.add_request(req("a", 3))
    s.add_request(req("b", 20))
    out = step(s)
    assert [(q.req_id, q.num_tokens, q.sample) for q in out.seqs] == [("a", 3, True), ("b", 5, False)]
    out = step(s)  # a decodes one token, b continues its prompt
    assert [(q.req_id, q.start_pos, q.num_tokens) for q in out.seqs] == [("a", 3, 1), ("b", 5, 7)]
    assert sum(q.num_tokens for q in out.seqs) == 8  # the whole token budget


def test_max_num_seqs_and_finish_by_length():
    s = make(max_num_seqs=2)
    for rid in "abc":
        s.add_request(req(rid, 2, max_tokens=2))
    out = step(s)
    assert [q.req_id for q in out.seqs] == ["a", "b"]
    step(s)  # a and b reach max_tokens
    assert s.num_running == 0
    out = step(s)
    assert [q.req_id for q in out.seqs] == ["c"] and set(out.finished_req_ids) == {"a", "b"}


def test_priority_orders_admission():
    s = make(max_num_seqs=1)
    s.add_request(req("low", 2, priority=5))
    s.add_request(req("high", 2, priority=-1))
    assert [q.req_id for q in step(s).seqs] == ["high"]


def test_preemption_frees_blocks_and_recomputes_prompt_plus_outputs():
    s = make(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    s.add_request(req("a", 7, max_tokens=8))
    s.add_request(req("b", 7, max_tokens=8, first=100))
    step(s)  # both prefilled: 2 blocks each, pool full
    step(s)  # both decode position 7, still in their second block
    out = step(s)  # a needs a third block for position 8: b (worst) is preempted
    assert out.num_preemptions == 1 and [q.req_id for q in out.seqs] == ["a"]
    b = s.requests["b"]
    assert b.num_computed_tokens == 0 and b.block_ids == [] and b.output_token_ids == [7, 7]
    a = s.requests["a"]
    while not a.is_finished:
        step(s)
    out = step(s)  # a finished; b returns with its prompt plus its tokens so far, to recompute
    assert out.new_requests[0].req_id == "b" and out.new_requests[0].token_ids == list(range(100, 107)) + [7, 7]


def test_stop_token_eos_min_tokens_and_abort():
    s = make()
    r = req("a", 2, max_tokens=10, stop_token_ids=(9,), min_tokens=2)
    r.eos_token_ids = (5,)
    s.add_request(r)
    step(s, token=5)  # below min_tokens: EOS does not stop
    assert not r.is_finished
    step(s, token=9)
    assert r.finish_reason == FinishReason.STOP and r.stop_reason == 9
    s.add_request(req("b", 2))
    step(s)
    aborted = s.finish_request("b", FinishReason.ABORT)
    assert aborted.finish_reason == FinishReason.ABORT and s.block_manager.num_free_blocks == 64


def test_prefix_cache_counters_count_each_admitted_request_once():
    s = make(num_blocks=8, block_size=4, max_num_batched_tokens=64)
    s.add_request(req("a", 12, max_tokens=1))
    step(s)  # a runs and finishes; its three full blocks stay cached
    s.add_request(req("big", 20, max_tokens=4, first=500))  # takes 6 of the 8 blocks for 4 steps
    s.add_request(req("b", 12, max_tokens=1))  # hits 2 cached blocks but waits for a third
    for _ in range(8):
        step(s)
    bm = s.block_manager
    assert not s.has_unfinished()
    # a: 12 tokens, no hit; big: 20, no hit; b: 12 with 8 hit, counted once however long it waited
    assert bm.num_prefix_queries == 12 + 20 + 12 and bm.num_prefix_hits == 8


def test_worse_priority_decodes_sit_out_the_step_that_admits_a_better_request():
    s = make()
    s.add_request(req("batch", 3, max_tokens=8, priority=10))
    step(s)  # batch prefilled, now decoding
    s.add_request(req("interactive", 3, max_tokens=8, priority=0))
    out = step(s)
    assert [q.req_id for q in out.seqs] == ["interactive"]
    out = step(s)  # nothing waits: both run, better priority first
    assert [q.req_id for q in out.seqs] == ["interactive", "batch"]
    s.add_request(req("same", 3, max_tokens=8, priority=10))
    out = step(s)  # an equal priority does not make anyone wait
    assert [q.req_id for q in out.seqs] == ["interactive", "batch", "same"]


def test_a_better_request_that_cannot_be_admitted_does_not_stall_the_rest():
    s = make(max_num_seqs=1)
    s.add_request(req("batch", 3, max_tokens=8, priority=10))
    step(s)
    s.add_request(req("interactive", 3, priority=0))  # no seat free: max_num_seqs
    out = step(s)
    assert [q.req_id for q in out.seqs] == ["batch"]
