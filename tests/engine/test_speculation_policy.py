"""The speculation policy on made-up step times (no clock): it speculates where the measured
step cost and acceptance make a step yield tokens faster, and not where they don't."""
import pytest

from shardserve.engine.speculation_policy import SpeculationPolicy


def feed(policy: SpeculationPolicy, cost, sizes) -> None:
    for num_tokens in sizes:
        policy.observe_step(num_tokens, True, cost(num_tokens))


def test_fitted_step_cost_is_the_least_squares_line():
    policy = SpeculationPolicy(4)
    feed(policy, lambda t: 0.010 + 0.0005 * t, [1, 2, 5, 5, 9])
    cost = policy.step_cost()
    assert cost.fixed_s == pytest.approx(0.010) and cost.per_token_s == pytest.approx(0.0005)
    policy.observe_step(400, False, 5.0)  # a prefill step: not part of the fit
    assert policy.step_cost().per_token_s == pytest.approx(0.0005)


def test_memory_bound_small_batch_speculates_fully():
    policy = SpeculationPolicy(4)
    feed(policy, lambda t: 0.010 + 0.0001 * t, [1, 5, 1, 5])  # a row costs 1% of the step
    assert policy.num_drafts([4]) == 4  # prior: 1 + 1/2 + 1/4 + ... = 1.94 tokens for 1.04x the time


def test_compute_bound_batch_turns_speculation_off_unless_nearly_all_is_accepted():
    cost = lambda t: 0.005 + 0.001 * t  # noqa: E731  (batch 32: 37 ms; every row 1 ms more)
    policy = SpeculationPolicy(4)
    feed(policy, cost, [32, 40, 32, 64])
    for accepted in [3, 0, 0] * 40:  # a third of the verifications hold throughout, the rest not at all
        policy.observe_verification(3, accepted)
    assert policy.acceptance_rates()[:3] == pytest.approx([1 / 3] * 3, abs=0.01)
    assert policy.num_drafts([4] * 32) == 0
    # by hand: k = 1 at acceptance a: (32 + 32 a) / (5 + 64) ms beats 32 / 37 ms by 2% when a > 0.90
    policy = SpeculationPolicy(1)
    feed(policy, cost, [32, 64])
    for _ in range(1000):
        policy.observe_verification(1, 1)
    assert policy.acceptance_rates()[0] > 0.95 and policy.num_drafts([1] * 32) == 1
    for _ in range(400):
        policy.end_step()  # counts decay ...
        policy.observe_verification(1, 0)  # ... and the recent rejections dominate
    assert policy.acceptance_rates()[0] < 0.1 and policy.num_drafts([1] * 32) == 0


def test_unknown_cost_probes_with_one_proposal_and_backs_off_while_the_answer_is_no():
    policy = SpeculationPolicy(4, probe_interval=4, max_probe_interval=16)
    assert policy.num_drafts([0, 0]) == 0  # nothing to verify: no probe spent
    cost = lambda t: 0.005 + 0.001 * t  # noqa: E731
    decisions = []
    for _ in range(60):
        k = policy.num_drafts([3] * 8)
        decisions.append(k)
        policy.observe_step(8 + k * 8, True, cost(8 + k * 8))
        if k:
            for _ in range(8):
                policy.observe_verification(k, 0)  # nothing holds
        while len(policy._steps) > 3:  # the probe's point leaves the window soon
            policy._steps.popleft()
    probes = [i for i, k in enumerate(decisions) if k]
    assert set(decisions) == {0, 1}
    assert [b - a for a, b in zip(probes, probes[1:])] == [8, 16, 16, 16]  # 4 doubled, then capped at 16
    assert probes[0] == 0


def test_a_line_measured_at_batch_one_is_not_trusted_at_batch_32():
    policy = SpeculationPolicy(4)
    feed(policy, lambda t: 0.010 + 0.0001 * t, [1, 5] * 20)
    assert policy.step_cost(16, 160) is None and policy.step_cost(0, 5) is not None
    assert policy.num_drafts([4] * 32) == 1  # no line near 32 tokens: a one-proposal probe
