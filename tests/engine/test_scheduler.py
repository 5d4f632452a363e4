"""Scheduler policies on a pure-Python loop (no model): fake sampled tokens."""
from shardserve.config import SchedulerConfig, SpeculativeConfig
from shardserve.engine.block_manager import BlockManager
from shardserve.engine.interface import ModelRunnerOutput, SampledToken
from shardserve.engine.scheduler import Scheduler
from shardserve.engine.speculator import Speculator, accept_proposals
from shardserve.request import FinishReason, Request, SamplingParams


def make(num_blocks=64, block_size=4, **cfg) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, block_size), max_model_len=64)


def req(rid, n_prompt, max_tokens=4, priority=0, first=1, **kw) -> Request:
    prompt = list(range(first, first + n_prompt))
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **kw), seed=0, priority=priority)


def step(s: Scheduler, token: int = 7):
    out = s.schedule()
    result = ModelRunnerOutput({q.req_id: [SampledToken(token)] for q in out.seqs if q.sample})
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


# --- speculative decoding: proposals ride on decode chunks; update keeps what held ----------------
def speculating(**cfg) -> Scheduler:
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2,
                                        policy="always"))
    return Scheduler(SchedulerConfig(**cfg), BlockManager(64, 4), max_model_len=64, speculator=spec)


def verify(s: Scheduler, out, rows: list[int]):
    """The runner's answer to a step: every sampling row of a chunk gets a token, then the
    rows the proposals allow are kept (model_runner.py)."""
    sampled = {}
    for q in out.seqs:
        if q.sample:
            tokens = [SampledToken(t) for t in rows[: 1 + len(q.spec_token_ids)]]
            sampled[q.req_id] = accept_proposals(tokens, q.spec_token_ids)
    result = ModelRunnerOutput(sampled)
    s.update(out, result)
    return result


def test_proposals_ride_on_the_decode_chunk_and_rejected_ones_are_rolled_back():
    s = speculating()
    s.add_request(req("a", 6, max_tokens=20))  # prompt 1 2 3 4 5 6
    r = s.requests["a"]
    verify(s, s.schedule(), [2])  # prefill samples 2: "... 6 2"; "2" occurred before, followed by 3 4 5
    out = s.schedule()
    assert [(q.start_pos, q.num_tokens, q.spec_token_ids) for q in out.seqs] == [(6, 4, [3, 4, 5])]
    result = verify(s, out, [3, 4, 9, 8])  # 3 and 4 hold, 5 does not: the model put 9 there
    assert [t.token_id for t in result.sampled["a"]] == [3, 4, 9]
    assert r.output_token_ids == [2, 3, 4, 9]
    assert r.num_computed_tokens == 9 and r.num_tokens == 10  # KV of 6 2 3 4; 9 is computed next step
    assert s.speculator.stats.num_draft_tokens == 3 and s.speculator.stats.accepted_per_position == [1, 1, 0]


def test_a_stop_inside_a_verified_chunk_drops_the_tokens_after_it():
    s = speculating()
    s.add_request(req("a", 6, max_tokens=20, stop_token_ids=(4,)))
    verify(s, s.schedule(), [2])
    result = verify(s, s.schedule(), [3, 4, 5, 6])  # all three proposals hold, but 4 is a stop token
    assert [t.token_id for t in result.sampled["a"]] == [3, 4] and "a" not in s.requests
    assert s.block_manager.num_free_blocks == 64


def test_proposals_stay_within_max_tokens_budget_and_free_blocks():
    s = speculating()
    s.add_request(req("a", 6, max_tokens=3))
    verify(s, s.schedule(), [2])
    out = s.schedule()  # room for two more tokens, this step's included: one proposal at most
    assert out.seqs[0].spec_token_ids == [3]
    s = speculating(max_num_batched_tokens=2)
    s.add_request(req("a", 2, max_tokens=20))  # prompt 1 2
    verify(s, s.schedule(), [1])  # "1 2 1": 1 was followed by "2 1"
    out = s.schedule()  # the step's token budget of 2 leaves room for one proposal
    assert [(q.num_tokens, q.spec_token_ids) for q in out.seqs] == [(2, [2])]
    s = speculating()
    s.block_manager = s.block_manager.__class__(2, 4)  # prompt 6 + 1 token fill both blocks
    s.add_request(req("a", 6, max_tokens=20))
    verify(s, s.schedule(), [2])
    out = s.schedule()  # proposals would need a third block: a plain decode instead, nothing preempted
    assert [(q.num_tokens, q.spec_token_ids) for q in out.seqs] == [(1, [])] and out.num_preemptions == 0
