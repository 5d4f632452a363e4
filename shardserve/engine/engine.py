"""LLMEngine: add_request / step / abort. One step = schedule -> run the model -> update the
scheduler -> detokenize and check stop strings -> RequestOutputs.

    engine = LLMEngine(EngineConfig(model="smollm2"))
    engine.add_request("a", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step(): print(out.new_text, end="")
"""
from __future__ import annotations

import atexit
import random
import time

from shardserve.config import EngineConfig
from shardserve.engine.block_manager import BlockManager
from shardserve.engine.detokenizer import IncrementalDetokenizer
from shardserve.engine.model_loader import LoadedModel, load_model
from shardserve.engine.executor import ParallelExecutor
from shardserve.engine.interface import StepRecord
from shardserve.engine.model_runner import ModelRunner
from shardserve.engine.worker import StepStats, Worker
from shardserve.models.checkpoint import load_checkpoint
from shardserve.models.moe import expert_load, rebalance_experts
from shardserve.parallel.expert import ExpertLoadReport
from shardserve.parallel.launch import Ranks, serve_worker_and_exit, start_ranks
from shardserve.engine.scheduler import Scheduler
from shardserve.request import (
    CompletionOutput, Resume, FinishReason, InvalidRequestError, Request, RequestOutput, SamplingParams, TokenLogprob,
)


class LLMEngine:
    """A replica's engine. With a parallel layout (world size > 1) this process becomes rank 0
    and starts the other ranks (see shardserve/parallel/launch.py); a process that torchrun
    started as another rank serves as a worker inside this constructor and exits when the driver
    shuts down."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        self.config = config
        self.ranks: Ranks | None = None
        if loaded is None and config.parallel.world_size > 1:
            # a bad path or an impossible layout fails here, in one line, before any rank starts
            config.parallel.validate(load_checkpoint(config.model).config)
            self.ranks = start_ranks(config)
            if not self.ranks.groups.is_driver:
                serve_worker_and_exit(config, self.ranks)
        try:
            self.loaded = loaded or load_model(config, self.ranks.groups if self.ranks else None)
        except BaseException:
            self._close_ranks()
            raise
        self.tokenizer = self.loaded.tokenizer
        self.model_config = self.loaded.model_config
        self.max_model_len = self.loaded.max_model_len
        self.eos_token_ids = self.loaded.eos_token_ids
        kv = self.loaded.kv_cache
        self.block_manager = BlockManager(kv.num_blocks, kv.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len)
        self.runner = ModelRunner(self.loaded.model, self.model_config, kv, self.eos_token_ids, self.loaded.device)
        if self.ranks is not None:
            self.runner = ParallelExecutor(Worker(self.runner, self.ranks.groups))
            atexit.register(self.shutdown)
        self._seeds = random.Random(config.seed)
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._logprobs: dict[str, list[TokenLogprob]] = {}
        self._prompts: dict[str, str | None] = {}
        self.last_step: StepRecord | None = None  # the latest step's batch and wall time

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
        if isinstance(prompt, str) and not prompt:
            raise InvalidRequestError("prompt is empty", "prompt")
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate_prompt(token_ids)
        req = Request(
            req_id=req_id, prompt_token_ids=token_ids, params=params,
            seed=params.seed if params.seed is not None else self._seeds.getrandbits(63),
            eos_token_ids=self.eos_token_ids, priority=priority,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
        )
        detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, params)
        if resume is not None:
            self.validate_resume(token_ids, params, resume.output_token_ids)
            req.output_token_ids = list(resume.output_token_ids)
            for token_id in resume.output_token_ids:
                detokenizer.push(token_id)
            detokenizer.num_emitted_chars = min(resume.num_text_chars, len(detokenizer.text))
        self.scheduler.add_request(req)
        self._detokenizers[req_id] = detokenizer
        self._prompts[req_id] = prompt if isinstance(prompt, str) else None
        if params.logprobs is not None:
            self._logprobs[req_id] = []
        return req

    def validate_prompt(self, token_ids: list[int]) -> None:
        """Raise InvalidRequestError unless the prompt is non-empty, fits the window and the vocabulary."""
        if not token_ids:
            raise InvalidRequestError("prompt is empty", "prompt")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(token_ids)} tokens but the context window is {self.max_model_len} "
                "(prompt plus at least one generated token must fit)", "prompt")
        vocab = self.model_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise InvalidRequestError(f"token ids must be in [0, {vocab})", "prompt")

    def validate_resume(self, prompt_ids: list[int], params: SamplingParams, ids) -> None:
        """Raise InvalidRequestError unless `ids` can be a request's output so far."""
        if not ids:
            raise InvalidRequestError("resume_token_ids is empty", "resume_token_ids")
        if min(ids) < 0 or max(ids) >= self.model_config.vocab_size:
            raise InvalidRequestError(f"resume token ids must be in [0, {self.model_config.vocab_size})", "resume_token_ids")
        if len(ids) >= params.max_tokens or len(prompt_ids) + len(ids) >= self.max_model_len:
            raise InvalidRequestError("the resumed request has no token budget left", "resume_token_ids")

    def abort_request(self, req_id: str) -> RequestOutput | None:
        req = self.scheduler.finish_request(req_id, FinishReason.ABORT)
        return self._output(req, "", []) if req else None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def expert_load(self) -> ExpertLoadReport:
        """Expert load per MoE layer since the last rebalance, over all ranks (empty when dense)."""
        if isinstance(self.runner, ParallelExecutor):
            return ExpertLoadReport.from_ranks(self.runner.expert_load())
        return ExpertLoadReport.from_ranks([expert_load(self.runner.model)])

    def step_stats(self, reset: bool = True) -> list[StepStats]:
        """Per rank of a parallel replica: step time split into compute, communication and
        pipeline waiting, summed since the last reset ([] in a single process)."""
        if isinstance(self.runner, ParallelExecutor):
            return self.runner.step_stats(reset)
        return []

    def rebalance_experts(self) -> None:
        """Re-place experts from the load observed so far, on the running replica (no restart);
        outputs do not change, only which rank computes which expert."""
        if isinstance(self.runner, ParallelExecutor):
            self.runner.rebalance_experts()
        else:
            rebalance_experts(self.runner.model)

    def keep_alive(self) -> None:
        """Call when idle: lets the other ranks of a parallel replica know the driver lives."""
        if isinstance(self.runner, ParallelExecutor):
            self.runner.keep_alive()

    def shutdown(self) -> None:
        """Stop the other ranks of a parallel replica (nothing to do in a single process). After a
        failed step (a lost rank) the spawned ranks are killed at once rather than awaited: a
        survivor can be stuck in that step's collectives until `comm_timeout_s`."""
        told = True
        if isinstance(self.runner, ParallelExecutor):
            try:
                told = self.runner.shutdown()
            except Exception:  # a peer is already gone: the ranks are killed below
                told = False
        self._close_ranks(timeout_s=30.0 if told else 0.0)

    def _close_ranks(self, timeout_s: float = 30.0) -> None:
        if self.ranks is not None:
            self.ranks.close(timeout_s)
            self.ranks = None

    # --- the loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        sched = self.scheduler.schedule()
        result = self.runner.execute(sched)
        updated = self.scheduler.update(sched, result)
        now = time.monotonic()
        outputs = []
        for req in updated:
            token_id = req.output_token_ids[-1]
            if req.first_token_time is None:
                req.first_token_time = now
            sampled = result.sampled[req.req_id]
            if req.req_id in self._logprobs:
                self._logprobs[req.req_id].append(TokenLogprob(token_id, sampled.logprob, sampled.top_logprobs))
            stop = self._detokenizers[req.req_id].push(token_id)
            if stop is not None and not req.is_finished:
                self.scheduler.finish_request(req.req_id, FinishReason.STOP, stop)
            outputs.append(self._output(req, self._detokenizers[req.req_id].take_new_text(req.is_finished), [token_id]))
        batch = tuple((s.num_tokens, s.start_pos + s.num_tokens) for s in sched.seqs)
        self.last_step = StepRecord(batch, time.perf_counter() - start)
        return outputs

    def _output(self, req: Request, new_text: str, new_token_ids: list[int]) -> RequestOutput:
        detok = self._detokenizers[req.req_id]
        finished = req.is_finished
        completion = CompletionOutput(
            index=0, text=detok.text if finished else detok.text[: detok.num_emitted_chars],
            token_ids=list(req.output_token_ids),
            finish_reason=req.finish_reason.value if finished else None, stop_reason=req.stop_reason,
            logprobs=self._logprobs.get(req.req_id),
        )
        out = RequestOutput(
            req_id=req.req_id, prompt_token_ids=req.prompt_token_ids, outputs=[completion], finished=finished,
            new_text=new_text, new_token_ids=new_token_ids, num_cached_tokens=req.num_cached_tokens,
            prompt=self._prompts.get(req.req_id), arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time, first_token_time=req.first_token_time,
            finished_time=req.finished_time,
        )
        if finished:
            for table in (self._detokenizers, self._logprobs, self._prompts):
                table.pop(req.req_id, None)
        return out
