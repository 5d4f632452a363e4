"""How routed tokens spread over expert-parallel ranks: the busiest rank sets a MoE layer's pace.

Under expert parallelism each of R ranks holds E / R of the E routed experts, and every token
picks k distinct experts. The grouped GEMMs and the dispatch/combine all-to-alls of a layer end
when the busiest rank is done, so the cost model charges that rank's rows, not the mean.

Uniform routing (the planner knows no router statistics): a token's rows to one rank are
hypergeometric -- k draws without replacement from E experts of which m = E / R are the rank's:

    mean = k m / E = k / R
    var  = k (m / E) (1 - m / E) (E - k) / (E - 1)

Tokens route independently, so over T tokens a rank's rows have mean T k / R and variance T var,
close to normal for the batches served. The expected largest of R such loads is
mean + sigma * z_R, z_R the expected maximum of R standard normals, taken from Blom's
approximation of normal order statistics, Phi^-1((R - 0.375) / (R + 0.25)) (0.59, 1.05, 1.43
for R = 2, 4, 8 against the exact 0.56, 1.03, 1.42: within 5%, closer as R grows). The loads are weakly
negatively correlated (they sum to T k), which this treats as independent: a slight
overestimate of the excess, which is itself small -- sigma / mean ~ sqrt(R / (T k)) -- once
thousands of rows are routed. Real routers are less even than uniform (the reason engines
replicate hot experts); that skew is a property of a model and its traffic, not of these counts,
and is left to calibration.
"""
from __future__ import annotations

import math
from statistics import NormalDist

from shardserve.config import ModelConfig


def expected_max_standard_normal(num_draws: int) -> float:
    """E[max of `num_draws` independent standard normals], Blom's approximation; 0 for one draw."""
    if num_draws <= 1:
        return 0.0
    return NormalDist().inv_cdf((num_draws - 0.375) / (num_draws + 0.25))


def rank_rows_variance_per_token(model: ModelConfig, num_ranks: int) -> float:
    """Variance of the rows one token sends to one of `num_ranks` ranks (hypergeometric: k of E
    experts drawn, E / num_ranks of them the rank's)."""
    e, k = model.num_experts, model.num_experts_per_token
    if num_ranks <= 1 or e <= 1:
        return 0.0
    share = 1.0 / num_ranks
    return k * share * (1.0 - share) * (e - k) / (e - 1)


def busiest_rank_rows(model: ModelConfig, num_ranks: int, num_tokens: float) -> float:
    """Expected routed rows on the busiest of `num_ranks` expert-parallel ranks when `num_tokens`
    tokens each pick k experts uniformly: T k / R + z_R sqrt(T var), capped at what a rank can
    take (every token's min(k, E / R) picks landing on it)."""
    if not model.is_moe or num_tokens <= 0:
        return 0.0
    k = model.num_experts_per_token
    mean = num_tokens * k / num_ranks
    if num_ranks <= 1:
        return mean
    sigma = math.sqrt(num_tokens * rank_rows_variance_per_token(model, num_ranks))
    ceiling = num_tokens * min(k, model.num_experts / num_ranks)
    return min(ceiling, mean + expected_max_standard_normal(num_ranks) * sigma)
