"""Plain data crossing the scheduler / model-runner boundary (and, later, process boundaries).

The runner keeps its own copy of each request's token ids: a request's token ids and sampling
parameters travel once, in `NewRequestData`, when it is first scheduled (or rescheduled after a
preemption); afterwards each step only says how many tokens of it to compute.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from shardserve.request import SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    token_ids: list[int]  # prompt plus any tokens generated before a preemption
    params: SamplingParams
    seed: int
    num_prompt_tokens: int  # penalties treat prompt and output tokens differently


@dataclass
class ScheduledSeq:
    """Compute tokens `[start_pos, start_pos + num_tokens)` of a request this step."""

    req_id: str
    start_pos: int
    num_tokens: int
    block_ids: list[int]  # the whole block table
    sample: bool  # the chunk reaches the request's last known token: sample the next one
    # proposed tokens (speculative decoding): the chunk is the last known token followed by
    # these, and every row is sampled to verify them (engine/speculator.py)
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    seqs: list[ScheduledSeq] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)  # the runner may drop their state
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # a draft model's guesses to make after this step, per sampled request
    num_draft_requests: int | None = None  # for how many sampled requests (None: all; a probe asks one)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class ModelRunnerOutput:
    # req_id -> the tokens it got this step: one, or after a verification the proposals that
    # held and the token sampled after them
    sampled: dict[str, list[SampledToken]] = field(default_factory=dict)
    proposals: dict[str, list[int]] | None = None  # a draft model's guesses for the next step


@dataclass(frozen=True)
class StepRecord:
    """What one engine step computed and how long it took (read by the server's live efficiency
    metrics; no profiler involved)."""

    batch: tuple[tuple[int, int], ...]  # (new tokens, context length) per scheduled sequence
    duration_s: float  # wall time of LLMEngine.step()


# --- driver -> workers, broadcast over the control group (see engine/executor.py) ------------------
@dataclass
class Heartbeat:
    """Sent when the driver has nothing to run, so a silent driver means a dead one."""


@dataclass
class Shutdown:
    """The replica is stopping: workers leave their loop and exit cleanly."""


@dataclass
class CollectExpertLoad:
    """Every rank sends the driver its MoE layers' load counters (gather_object)."""


@dataclass
class RebalanceExperts:
    """Every rank re-places its expert-parallel layers' experts from their observed load."""


@dataclass
class CollectStepStats:
    """Every rank sends the driver where its step time went (compute, communication, waiting)."""

    reset: bool = True
