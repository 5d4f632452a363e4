"""Workloads: who asks for what, and when. Shared by the load client (`bench/`) and the simulator.

A workload is a list of `RequestSpec`: a prompt (token ids or text), how many tokens to generate,
and when the request arrives, as an offset from the start of the run. Everything here is pure
Python + numpy and deterministic given a seed, so a simulated run and a measured run can be fed
exactly the same requests.

Three independent parts compose into `build_workload` (or `iter_workload`, the same requests drawn lazily):
  lengths   random_lengths | sharegpt_like_lengths | load_trace_jsonl  -> (prompt_len, output_len)
  prompts   synthesize_prompt_ids                                       -> token ids per prompt_len
  arrivals  poisson_arrivals | gamma_arrivals | closed_loop_arrivals
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

DEFAULT_VOCAB_RANGE = (100, 40000)  # [low, high): avoids the special / byte tokens of common vocabs


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload. Exactly one of `prompt_token_ids` / `prompt_text` is set.
    `arrival_time_s` is the offset from the start of the run (0 for closed-loop workloads)."""

    prompt_token_ids: tuple[int, ...] | None
    prompt_text: str | None
    output_len: int
    arrival_time_s: float = 0.0

    @property
    def prompt_len(self) -> int | None:
        """Prompt length in tokens when known without a tokenizer (token-id prompts), else None."""
        return None if self.prompt_token_ids is None else len(self.prompt_token_ids)

    @property
    def prompt(self) -> str | list[int]:
        """The prompt as an OpenAI `/v1/completions` `prompt` field takes it."""
        return self.prompt_text if self.prompt_token_ids is None else list(self.prompt_token_ids)


@dataclass(frozen=True)
class LognormalLengths:
    """A length distribution: exp(Normal(mean_log, sigma_log)) rounded, clipped to [min_len, max_len]."""

    mean_log: float
    sigma_log: float
    min_len: int
    max_len: int

    def sample(self, rng: np.random.Generator, num: int) -> np.ndarray:
        raw = rng.lognormal(self.mean_log, self.sigma_log, size=num)
        return np.clip(np.rint(raw), self.min_len, self.max_len).astype(np.int64)


# ShareGPT-like lengths. We have no network access to fit the raw dataset, so these lognormals
# are fit to published summary statistics of ShareGPT as used by serving papers (vLLM, Kwon et
# al. 2023, Fig. 11: mean prompt 161 tokens, mean output 338 tokens) plus the shape of their
# histograms: prompts are strongly right-skewed (median well below the mean, a long tail of pasted
# documents), outputs less so. mean = exp(mean_log + sigma_log^2 / 2):
#   prompt: sigma 1.2 -> median exp(4.36) ~ 78 tokens, mean ~ 161 (before clipping)
#   output: sigma 0.9 -> median exp(5.42) ~ 226 tokens, mean ~ 338 (before clipping)
# Clipping to [4, 2048] / [4, 1024] lowers the sampled means a little, to ~ 157 and ~ 313.
# Prompt and output lengths are drawn independently (ShareGPT's correlation between them is weak).
SHAREGPT_PROMPT_LENGTHS = LognormalLengths(mean_log=4.36, sigma_log=1.2, min_len=4, max_len=2048)
SHAREGPT_OUTPUT_LENGTHS = LognormalLengths(mean_log=5.42, sigma_log=0.9, min_len=4, max_len=1024)


def random_lengths(num: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                   seed: int = 0) -> list[tuple[int, int]]:
    """`num` (prompt_len, output_len) pairs, each uniform over the integers in
    [len * (1 - range_ratio), len * (1 + range_ratio)] (at least 1). range_ratio 0 gives fixed lengths."""
    _check_count(num)
    if input_len < 1 or output_len < 1:
        raise ValueError(f"input_len and output_len must be >= 1, got {input_len} and {output_len}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    prompt_lens = _uniform_around(rng, input_len, range_ratio, num)
    output_lens = _uniform_around(rng, output_len, range_ratio, num)
    return list(zip(prompt_lens.tolist(), output_lens.tolist()))


def _uniform_around(rng: np.random.Generator, center: int, ratio: float, num: int) -> np.ndarray:
    low = max(1, math.floor(center * (1 - ratio)))
    high = max(low, math.ceil(center * (1 + ratio)))
    return rng.integers(low, high + 1, size=num)


def sharegpt_like_lengths(num: int, seed: int = 0) -> list[tuple[int, int]]:
    """`num` (prompt_len, output_len) pairs from the ShareGPT-like lognormals above."""
    _check_count(num)
    rng = np.random.default_rng(seed)
    prompt_lens = SHAREGPT_PROMPT_LENGTHS.sample(rng, num)
    output_lens = SHAREGPT_OUTPUT_LENGTHS.sample(rng, num)
    return list(zip(prompt_lens.tolist(), output_lens.tolist()))


def load_trace_jsonl(path: str | Path) -> list[RequestSpec]:
    """Read a trace: one JSON object per line, `{"prompt": str | [token ids], "output_len": int,
    "arrival_time_s": float (optional, default 0)}`. Blank lines are skipped. A bad line raises
    ValueError naming the file and line number."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    specs = []
    for line_no, line in enumerate(lines, start=1):
        if line.strip():
            try:
                specs.append(_parse_trace_line(line))
            except ValueError as exc:
                raise ValueError(f"{path}:{line_no}: {exc}") from None
    if not specs:
        raise ValueError(f"trace {path} holds no requests")
    return specs


def _parse_trace_line(line: str) -> RequestSpec:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    prompt, output_len = obj.get("prompt"), obj.get("output_len")
    arrival_s = obj.get("arrival_time_s", 0.0)
    if isinstance(output_len, bool) or not isinstance(output_len, int) or output_len < 1:
        raise ValueError(f"'output_len' must be an integer >= 1, got {output_len!r}")
    if isinstance(arrival_s, bool) or not isinstance(arrival_s, (int, float)) or not 0 <= arrival_s < math.inf:
        raise ValueError(f"'arrival_time_s' must be a finite number >= 0, got {arrival_s!r}")
    if isinstance(prompt, str) and prompt:
        return RequestSpec(None, prompt, output_len, float(arrival_s))
    if (isinstance(prompt, list) and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)):
        return RequestSpec(tuple(prompt), None, output_len, float(arrival_s))
    raise ValueError("'prompt' must be a non-empty string or a non-empty list of token ids >= 0")


def gamma_arrivals(num: int, rate_qps: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Arrival offsets (s) of a renewal process: the first request at 0, then i.i.d. gaps
    ~ Gamma(shape=burstiness, scale=1 / (rate_qps * burstiness)). The mean gap is 1 / rate_qps at
    any burstiness; the gaps' coefficient of variation is 1 / sqrt(burstiness): burstiness 1 is
    Poisson, < 1 burstier, > 1 smoother. rate_qps = inf sends everything at 0."""
    _check_count(num)
    if not rate_qps > 0:
        raise ValueError(f"rate_qps must be > 0, got {rate_qps}")
    if not 0 < burstiness < math.inf:
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")
    if math.isinf(rate_qps):
        return closed_loop_arrivals(num)
    rng = np.random.default_rng(seed)
    gaps_s = rng.gamma(burstiness, 1.0 / (rate_qps * burstiness), size=max(num - 1, 0))
    return [0.0, *np.cumsum(gaps_s).tolist()][:num]


def poisson_arrivals(num: int, rate_qps: float, seed: int = 0) -> list[float]:
    """Poisson arrivals (exponential gaps) at `rate_qps`; identical to `gamma_arrivals` at burstiness 1."""
    return gamma_arrivals(num, rate_qps, 1.0, seed)


def closed_loop_arrivals(num: int) -> list[float]:
    """All requests available at 0: the client's concurrency decides when each is sent."""
    _check_count(num)
    return [0.0] * num


def synthesize_prompt_ids(prompt_lens: list[int], seed: int | Sequence[int] = 0,
                          vocab_range: tuple[int, int] = DEFAULT_VOCAB_RANGE) -> list[tuple[int, ...]]:
    """Random token-id prompts, ids uniform in [vocab_range[0], vocab_range[1]); `seed` is anything
    `np.random.default_rng` takes. Independent random prompts share no prefix, so prefix caching
    cannot shortcut a benchmark built from them."""
    low, high = vocab_range
    if not 0 <= low < high:
        raise ValueError(f"vocab_range must satisfy 0 <= low < high, got {vocab_range}")
    rng = np.random.default_rng(seed)
    return [tuple(rng.integers(low, high, size=n).tolist()) for n in prompt_lens]


@dataclass(frozen=True)
class WorkloadConfig:
    """What `build_workload` builds. `dataset` is "random", "sharegpt" or "jsonl:PATH".
    request_rate_qps None means no generated arrivals: closed loop (all 0), or a jsonl trace's own
    `arrival_time_s`. input_len / output_len / range_ratio apply to "random" only. `prompt_salt`
    changes the synthetic prompts' token ids but not their lengths: runs that must not hit each
    other's prefix cache (successive load levels against one server) use different salts."""

    num_requests: int
    dataset: str = "random"
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.0
    request_rate_qps: float | None = None
    burstiness: float = 1.0
    seed: int = 0
    prompt_salt: int = 0
    vocab_range: tuple[int, int] = DEFAULT_VOCAB_RANGE


def build_workload(config: WorkloadConfig) -> list[RequestSpec]:
    """The requests of one run. Lengths, prompts and arrivals draw from separate seeds derived from
    `config.seed`, so changing the rate keeps the same prompts and lengths. A jsonl trace is cut to
    its first `num_requests` lines (fewer if the trace is shorter)."""
    _check_count(config.num_requests)
    if config.dataset.startswith("jsonl:"):
        specs = load_trace_jsonl(config.dataset[len("jsonl:"):])[:config.num_requests]
    else:
        specs = _synthetic_specs(config)
    if config.request_rate_qps is None:
        return specs
    arrivals_s = gamma_arrivals(len(specs), config.request_rate_qps, config.burstiness, config.seed + 2)
    return [dataclasses.replace(s, arrival_time_s=t) for s, t in zip(specs, arrivals_s)]


def _synthetic_lengths(config: WorkloadConfig) -> list[tuple[int, int]]:
    """(prompt length, output length) of each synthetic request."""
    if config.dataset == "random":
        return random_lengths(config.num_requests, config.input_len, config.output_len, config.range_ratio, config.seed)
    if config.dataset == "sharegpt":
        return sharegpt_like_lengths(config.num_requests, config.seed)
    raise ValueError(f"unknown dataset {config.dataset!r}; expected random, sharegpt or jsonl:PATH")


def _synthetic_specs(config: WorkloadConfig) -> list[RequestSpec]:
    lengths = _synthetic_lengths(config)
    prompts = synthesize_prompt_ids([p for p, _ in lengths], (config.seed + 1, config.prompt_salt), config.vocab_range)
    return [RequestSpec(ids, None, out_len, 0.0) for ids, (_, out_len) in zip(prompts, lengths)]


def _check_count(num: int) -> None:
    if num < 0:
        raise ValueError(f"the number of requests must be >= 0, got {num}")


def iter_workload(config: WorkloadConfig) -> Iterator[RequestSpec]:
    """The requests of `build_workload(config)`, one at a time and equal to them, drawing each
    synthetic prompt only when it is reached: a million-request simulation then holds the prompts
    of the requests in flight, not all of them."""
    _check_count(config.num_requests)
    if config.dataset.startswith("jsonl:"):
        yield from build_workload(config)
        return
    lengths = _synthetic_lengths(config)
    if config.request_rate_qps is None:
        arrivals_s = [0.0] * len(lengths)
    else:
        arrivals_s = gamma_arrivals(len(lengths), config.request_rate_qps, config.burstiness, config.seed + 2)
    low, high = config.vocab_range
    if not 0 <= low < high:
        raise ValueError(f"vocab_range must satisfy 0 <= low < high, got {config.vocab_range}")
    # synthesize_prompt_ids' draws, in order; drawn a batch of prompts at a time (one call for many
    # prompts yields the same ids as one call per prompt: tests/bench/test_workload.py)
    rng = np.random.default_rng((config.seed + 1, config.prompt_salt))
    batch = 4096
    for first in range(0, len(lengths), batch):
        chunk = lengths[first:first + batch]
        ids = rng.integers(low, high, size=sum(p for p, _ in chunk)).tolist()
        start = 0
        for (prompt_len, output_len), arrival_s in zip(chunk, arrivals_s[first:first + batch]):
            yield RequestSpec(tuple(ids[start:start + prompt_len]), None, output_len, arrival_s)
            start += prompt_len
