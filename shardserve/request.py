"""What a user asks for (SamplingParams), the engine's record of it (Request) and what it gets
back (RequestOutput). Plain Python: the scheduler imports this, so no torch here."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class InvalidRequestError(ValueError):
    """A request the engine cannot serve as asked; the message names the parameter.
    `param` is the offending field (the server reports it in the OpenAI error shape)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# the SamplingParams fields a model's generation_config.json may set (models/sampling_defaults.py);
# requests that leave them out take the model's values
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on the output's text (engine/grammar.py compiles it): exactly one of a JSON
    schema (as JSON text), any JSON object, a regular expression, one of a list of strings, or a
    grammar (Lark, or GBNF). `source` is the request field it came from, for error messages."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] = ()
    grammar: str | None = None
    source: str | None = field(default=None, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "choice", tuple(self.choice or ()))
        kinds = [self.json is not None, self.json_object, self.regex is not None, bool(self.choice),
                 self.grammar is not None]
        if sum(kinds) != 1:
            raise InvalidRequestError("structured outputs take exactly one of json, json_object, regex, choice "
                                      "and grammar", self.param)
        if any(not isinstance(c, str) or not c for c in self.choice):
            raise InvalidRequestError("each choice must be a non-empty string", self.param)

    @property
    def param(self) -> str:
        """The request field it came from, as errors name it."""
        return self.source or "structured_outputs"


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Defaults follow vLLM's.

    Sampling with a `seed` is a pure function of (seed, position, logits): the same request
    re-run from its prompt plus its first k tokens reproduces tokens k+1.. exactly.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # return the sampled token's logprob and this many top ones (-1: the whole vocabulary)
    logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self):
        # Accept lists from callers; keep the dataclass hashable and immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self.validate()

    def validate(self) -> None:
        checks = [
            (self.max_tokens >= 1, "max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.min_tokens <= self.max_tokens, "min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            (self.temperature >= 0, "temperature", f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= -1, "top_k", f"top_k must be -1 (disabled) or positive, got {self.top_k}"),
            (0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0, "repetition_penalty", f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.logprobs is None or -1 <= self.logprobs <= 20, "logprobs",
             f"logprobs must be in [0, 20] (or -1: all), got {self.logprobs}"),
            (all(s for s in self.stop), "stop", "stop strings must not be empty"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequestError(message, param)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"


@dataclass(frozen=True)
class Resume:
    """Where another replica left a request: the tokens it generated and how many characters of
    their text the client already has."""

    output_token_ids: tuple[int, ...]
    num_text_chars: int = 0


@dataclass(eq=False, slots=True)
class Request:
    """The scheduler's record of one request. Token ids grow as tokens are sampled;
    `num_computed_tokens` counts those whose KV is in the cache."""

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # params.seed, or one drawn by the engine so every request samples reproducibly
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0  # lower runs first; ties go first-come first-served
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_seq: int = 0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first schedule
    num_preemptions: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of this request's full blocks, in order
    num_published_blocks: int = 0  # leading blocks already offered to the prefix cache
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    first_scheduled_time: float | None = None  # time.monotonic() values, for latency metrics
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival_seq)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    """What a step produced for a request: what is new since its previous output (`new_text`,
    `new_token_ids`, `new_logprobs`: a stream reads only these), and once it is finished, the
    whole completion in `outputs` (empty before: LLMEngine.output assembles it on demand)."""

    req_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprob] = field(default_factory=list)  # with SamplingParams.logprobs
    num_cached_tokens: int = 0
    prompt: str | None = None
    # time.monotonic() stamps: queue time = first_scheduled - arrival, TTFT = first_token - arrival
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
