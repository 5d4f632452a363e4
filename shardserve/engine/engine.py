"""LLMEngine: add_request / step / abort. One step = schedule -> execute -> update the scheduler
-> turn the sampled tokens into outputs (text, stop strings, logprobs).

    engine = build_engine(EngineConfig(model="smollm2"))      # engine/launcher.py
    engine.add_request("a", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step(): print(out.new_text, end="")

The engine runs the same code whatever the parallelism: its Executor (engine/executor.py) is the
local model or the driver's side of a parallel replica, chosen by the launcher.
"""
from __future__ import annotations

import random
import time

from shardserve.config import EngineConfig
from shardserve.engine.block_manager import BlockManager
from shardserve.engine.executor import Executor
from shardserve.engine.input_validator import InputValidator
from shardserve.engine.interface import StepRecord
from shardserve.engine.model_loader import LoadedModel
from shardserve.engine.model_runner import ModelRunner
from shardserve.engine.output_processor import OutputProcessor
from shardserve.engine.scheduler import Scheduler
from shardserve.engine.speculator import Speculator
from shardserve.engine.thread_governor import ThreadGovernor
from shardserve.engine.worker import StepStats
from shardserve.parallel.expert import ExpertLoadReport
from shardserve.request import FinishReason, Request, RequestOutput, Resume, SamplingParams


class LLMEngine:
    """A replica's engine: the scheduler, the output processor and an executor that runs steps."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel, executor: Executor,
                 threads: ThreadGovernor | None = None):
        self.config = config
        self.executor = executor
        self.threads = threads  # None: the thread count is left as it is
        self.tokenizer = loaded.tokenizer
        self.model_config = loaded.model_config
        self.max_model_len = loaded.max_model_len
        self.eos_token_ids = loaded.eos_token_ids
        self.sampling_defaults = loaded.sampling_defaults  # the model's, for fields a request leaves out
        kv = loaded.kv_cache
        self.block_manager = BlockManager(kv.num_blocks, kv.block_size, config.cache.enable_prefix_caching)
        self.speculator = Speculator(config.speculative) if config.speculative else None
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len, self.speculator)
        self.validator = InputValidator(self.tokenizer, self.model_config.vocab_size, self.max_model_len,
                                        loaded.grammars)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._seeds = random.Random(config.seed)
        self.last_step: StepRecord | None = None  # the latest step's batch and wall time

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's own defaults (vLLM's get_default_sampling_params)."""
        return SamplingParams(**self.sampling_defaults)

    @property
    def runner(self) -> ModelRunner:
        """This process's model runner (rank 0's, in a parallel replica)."""
        return self.executor.runner

    # --- requests ------------------------------------------------------------------------------
    def add_request(self, req_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None,
                    resume: "Resume | None" = None) -> Request:
        """Queue a request. Raises InvalidRequestError for an empty prompt, a prompt that does not
        fit the context window, or token ids outside the vocabulary.

        `resume` continues a request another replica started: its output tokens so far are taken
        as generated here (recomputed like after a preemption), so a greedy or seeded request
        goes on with exactly the tokens it would have produced there, and the text already
        delivered (`resume.num_text_chars`) is not sent again."""
        params = params or SamplingParams()
        token_ids = self.validator.prompt_ids(prompt)
        self.validator.sampling(params)
        if resume is not None:
            self.validator.resume(token_ids, params, resume.output_token_ids)
        req = Request(
            req_id=req_id, prompt_token_ids=token_ids, params=params,
            seed=params.seed if params.seed is not None else self._seeds.getrandbits(63),
            eos_token_ids=self.eos_token_ids, priority=priority,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
        )
        if resume is not None:
            req.output_token_ids = list(resume.output_token_ids)
        self.scheduler.add_request(req)
        self.output_processor.add(req, prompt if isinstance(prompt, str) else None, resume)
        return req

    def abort_request(self, req_id: str) -> RequestOutput | None:
        req = self.scheduler.finish_request(req_id, FinishReason.ABORT)
        return self.output_processor.finish(req) if req else None

    def output(self, req_id: str) -> RequestOutput | None:
        """An unfinished request's whole output so far (text, token ids, logprobs), or None."""
        req = self.scheduler.requests.get(req_id)
        return self.output_processor.output(req) if req else None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- the executor's services -----------------------------------------------------------------
    def expert_load(self) -> ExpertLoadReport:
        return self.executor.expert_load()

    def step_stats(self, reset: bool = True) -> list[StepStats]:
        return self.executor.step_stats(reset)

    def weight_bytes_per_param(self) -> float | None:
        """Bytes a step reads per weight parameter where the weights are quantized; None where
        they keep --dtype (models/decoder.py)."""
        return self.runner.model.weight_bytes_per_param()

    def rebalance_experts(self) -> None:
        """Re-place experts from the load observed so far, on the running replica (no restart)."""
        self.executor.rebalance_experts()

    def warm_up(self) -> None:
        """Run one tiny greedy request through a prefill and a few decodes, so that the first
        user request does not pay for first calls (oneDNN's kernel selection, the thread pool's
        start, lazy allocations). It fills less than one KV block, so the prefix cache keeps
        nothing of it, and it draws no seed."""
        num_tokens = min(self.block_manager.block_size - 1, self.max_model_len)
        num_prompt = max(1, num_tokens // 2)
        prompt = [self.model_config.vocab_size // 2] * num_prompt
        params = SamplingParams(max_tokens=max(1, num_tokens - num_prompt), temperature=0, seed=0, ignore_eos=True)
        req = self.add_request("shardserve-warm-up", prompt, params)
        while not req.is_finished:
            self.step()
        if self.speculator:  # its proposals are not traffic (the policy keeps what it measured)
            self.speculator.clear_stats()

    def keep_alive(self) -> None:
        self.executor.keep_alive()

    def shutdown(self) -> None:
        self.executor.shutdown()

    # --- the loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        if self.threads:
            self.threads.before_step()
        sched = self.scheduler.schedule()
        result = self.executor.execute(sched)
        updated = self.scheduler.update(sched, result)
        outputs = self.output_processor.process(updated, result.sampled, self._stop_at_string)
        batch = tuple((s.num_tokens, s.start_pos + s.num_tokens) for s in sched.seqs)
        self.last_step = StepRecord(batch, time.perf_counter() - start)
        num_tokens = sum(n for n, _ in batch)
        if self.speculator:
            decode_only = all(s.sample and s.num_tokens == 1 + len(s.spec_token_ids) for s in sched.seqs)
            self.speculator.observe_step(num_tokens, decode_only, self.last_step.duration_s)
        if self.threads:
            self.threads.after_step(num_tokens, self.last_step.duration_s)
        return outputs

    def _stop_at_string(self, req_id: str, stop: str) -> None:
        self.scheduler.finish_request(req_id, FinishReason.STOP, stop)
