import math

import pytest
import torch

from shardserve.engine.sampler import SamplingState, _probabilities, argmax_suffices, sample
from shardserve.request import InvalidRequestError, SamplingParams


def state(tokens=(1, 2, 3), num_prompt=3, seed=0, **params) -> SamplingState:
    return SamplingState(SamplingParams(**params), seed, list(tokens), num_prompt, eos_token_ids=(0,))


def test_greedy_picks_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2, -1.0]])
    assert sample(logits, [state(temperature=0)])[0].token_id == 1


@pytest.mark.parametrize("params, suffices", [
    (dict(temperature=0), True),
    (dict(temperature=0.7, top_k=1), True),
    (dict(temperature=0, ignore_eos=True, min_tokens=0), True),
    (dict(temperature=0.7), False),
    (dict(temperature=0, logprobs=0), False),
    (dict(temperature=0, repetition_penalty=1.1), False),
    (dict(temperature=0, presence_penalty=0.5), False),
    (dict(temperature=0, min_tokens=2), False),  # EOS still masked: the argmax may be banned
])
def test_argmax_suffices_exactly_where_sample_answers_with_the_argmax(params, suffices):
    """The model runner skips the logits when this says so: sample must then give the argmax."""
    torch.manual_seed(2)
    logits = torch.randn(4, 50)
    logits[:, 0] += 10  # EOS (id 0) the largest: min_tokens would ban it
    states = [state(**params) for _ in range(4)]
    assert argmax_suffices(states) is suffices
    if suffices:
        assert [t.token_id for t in sample(logits, states)] == logits.argmax(dim=-1).tolist()
    assert argmax_suffices([state(temperature=0), states[0]]) is suffices  # one row decides the batch


def test_seeded_draw_depends_only_on_seed_position_and_logits():
    torch.manual_seed(0)
    logits = torch.randn(1, 1000)
    a = sample(logits, [state(seed=42)])[0].token_id
    # other rows in the batch and global RNG state must not matter
    torch.manual_seed(123)
    batch = sample(torch.cat([torch.randn(2, 1000), logits]), [state(seed=1), state(seed=2), state(seed=42)])
    assert batch[2].token_id == a
    # a different position gives (almost surely) a different draw sequence
    draws = {sample(logits, [state(tokens=range(n), num_prompt=n, seed=42)])[0].token_id for n in range(3, 23)}
    assert len(draws) > 5


def test_sampling_frequencies_follow_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log().unsqueeze(0)
    counts = torch.zeros(3)
    for seed in range(3000):
        counts[sample(logits, [state(seed=seed)])[0].token_id] += 1
    assert torch.allclose(counts / 3000, probs, atol=0.03)


def test_top_k_top_p_min_p_restrict_the_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    for params, allowed in [(dict(top_k=2), {0, 1}), (dict(top_p=0.5), {0}), (dict(top_p=0.9), {0, 1, 2}),
                            (dict(min_p=0.3), {0, 1})]:
        seen = {sample(logits, [state(seed=s, **params)])[0].token_id for s in range(300)}
        assert seen == allowed, params


def reference_probabilities(logits, params):
    """top-k, top-p and min-p by sorting whole rows, the rule written out plainly."""
    rows = []
    for row, p in zip(logits, params):
        row = row / p.temperature
        if p.top_k > 0:
            row = row.masked_fill(row < row.sort(descending=True).values[p.top_k - 1], float("-inf"))
        probs = row.softmax(-1)
        values, order = probs.sort(descending=True)
        probs = torch.zeros_like(probs).scatter_(0, order, values.masked_fill(values.cumsum(-1) - values >= p.top_p, 0))
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0)
        rows.append(probs / probs.sum())
    return torch.stack(rows)


def test_top_k_and_top_p_from_candidates_match_sorting_the_whole_row():
    """Peaked rows find their nucleus among 256 candidates, flatter ones among 4,096, flat ones
    in the whole row: all three paths are taken, and each keeps exactly the sorted rule's tokens."""
    torch.manual_seed(0)
    logits = torch.cat([torch.randn(4, 49152) * scale for scale in (0.3, 3.0, 12.0)])
    params = [SamplingParams(temperature=t, top_p=p, top_k=k, min_p=m) for t, p, k, m in
              [(1.0, 0.9, -1, 0), (0.7, 0.5, -1, 0), (1.0, 0.99, 40, 0), (1.3, 0.95, 3000, 0.01)] * 3]
    ours = _probabilities(logits, params)
    assert torch.equal(ours > 0, reference_probabilities(logits, params) > 0)
    torch.testing.assert_close(ours, reference_probabilities(logits, params), rtol=1e-5, atol=1e-9)


def test_penalties_and_min_tokens():
    logits = torch.tensor([[2.0, 2.0, 1.9, -1.0]])
    # token 0 is EOS: banned below min_tokens
    assert sample(logits, [state(temperature=0, min_tokens=1)])[0].token_id == 1
    # repetition penalty divides positive logits of seen tokens: 2.0 -> 1.0 < 1.9
    three = torch.tensor([[2.0, 1.9, -1.0]])
    assert sample(three, [state(tokens=(5,), num_prompt=1, temperature=0)])[0].token_id == 0
    assert sample(three, [state(tokens=(0,), num_prompt=1, temperature=0, repetition_penalty=2.0)])[0].token_id == 1
    # frequency penalty applies to generated tokens only: token 1 generated twice
    out = sample(logits, [state(tokens=(3, 1, 1), num_prompt=1, temperature=0, frequency_penalty=0.1, min_tokens=0)])
    assert out[0].token_id == 0


def test_logprobs_are_raw_log_softmax_with_top_n():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    tok = sample(logits, [state(temperature=0, logprobs=2)])[0]
    expected = torch.log_softmax(logits[0], -1)
    assert tok.token_id == 2 and math.isclose(tok.logprob, float(expected[2]), rel_tol=1e-6)
    assert [t for t, _ in tok.top_logprobs] == [2, 1]


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(top_p=0.0), dict(top_p=1.5), dict(temperature=-1),
                                 dict(top_k=-2), dict(min_p=2), dict(logprobs=50), dict(stop=[""])])
def test_invalid_params_raise_with_param_name(bad):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**bad)
    assert err.value.param == next(iter(bad))
