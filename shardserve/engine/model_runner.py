"""Runs one engine step on the model: turns a SchedulerOutput into packed tensors, runs the
forward pass over the paged KV cache, and samples the next token of each finished chunk (every
row of a chunk that verifies proposed tokens)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Protocol

import torch

from shardserve.config import ModelConfig
from shardserve.engine.cuda_graphs import DecodeGraphs
from shardserve.engine.draft_proposer import DraftProposer, DraftRequest
from shardserve.engine.grammar import Grammars, bitmask_words
from shardserve.engine.interface import ModelRunnerOutput, SampledToken, ScheduledSeq, SchedulerOutput
from shardserve.engine.kv_cache import KVCache
from shardserve.engine.sampler import SamplingState, argmax_suffices, sample
from shardserve.engine.speculator import accept_proposals
from shardserve.layers.attention.backend import AttentionBackend
from shardserve.layers.attention.paged_kv import SeqSpan
from shardserve.layers.cpu_kernels import build_all


class Stage(Protocol):
    """Where this process sits in the model: which layers it runs and who it talks to."""

    is_last: bool  # runs the final norm and the LM head
    samples: bool  # samples the next tokens (one rank of the last stage)

    def micro_batches(self, seqs: list[ScheduledSeq]) -> list[list[ScheduledSeq]]: ...
    def receive(self, num_tokens: int) -> torch.Tensor | None: ...
    def compute(self, run: Callable[[], dict[str, list[SampledToken]]]) -> dict[str, list[SampledToken]]: ...
    def send(self, hidden: torch.Tensor) -> None: ...
    def finish(self, sampled: dict[str, list[SampledToken]]) -> dict[str, list[SampledToken]]: ...


class WholeModel:
    """The Stage of a single process: every layer, one micro-batch, nothing to send."""

    is_last = samples = True

    def micro_batches(self, seqs: list[ScheduledSeq]) -> list[list[ScheduledSeq]]:
        return [seqs]

    def receive(self, num_tokens: int) -> None:
        return None

    def compute(self, run: Callable[[], dict[str, list[SampledToken]]]) -> dict[str, list[SampledToken]]:
        return run()

    def send(self, hidden: torch.Tensor) -> None:
        raise AssertionError("the whole model has no next stage")

    def finish(self, sampled: dict[str, list[SampledToken]]) -> dict[str, list[SampledToken]]:
        return sampled


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: object  # the attention backend's metadata
    sample_indices: torch.Tensor  # [R] the rows to sample: each sampling sequence's last, or all of a verified chunk
    sample_req_ids: list[str]  # the sampling sequences, in row order
    sample_drafts: list[list[int]]  # each one's proposed tokens ([] unless it verifies some)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, kv_cache: KVCache,
                 eos_token_ids: tuple[int, ...], device: torch.device, attention: AttentionBackend,
                 grammars: Grammars | None = None, graphs: DecodeGraphs | None = None,
                 draft: DraftProposer | None = None):
        self.model = model
        self.model_config = model_config
        self.kv_cache = kv_cache
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.attention = attention
        self.grammars = grammars  # for requests with structured outputs
        self.graphs = graphs  # decode steps replayed from CUDA graphs (GPU, one process)
        self.draft = draft  # speculative decoding's draft model (one process)
        self.states: dict[str, SamplingState] = {}
        if device.type == "cpu":  # compiled now (then cached on disk), not while a first request waits
            build_all()

    @classmethod
    def for_model(cls, loaded, graphs: DecodeGraphs | None = None, draft: DraftProposer | None = None) -> "ModelRunner":
        """The runner of a loaded model (engine/model_loader.py's LoadedModel)."""
        return cls(loaded.model, loaded.model_config, loaded.kv_cache, loaded.eos_token_ids, loaded.device,
                   loaded.attention, loaded.grammars, graphs, draft)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, stage: "Stage | None" = None) -> ModelRunnerOutput:
        """One step: forward over every scheduled chunk, then sample. `stage` is this process's
        place in a pipeline (engine/worker.py); None: the whole model runs here."""
        stage = stage or WholeModel()
        self.update_states(sched)
        if sched.is_empty:
            return ModelRunnerOutput()
        sampled: dict[str, list[SampledToken]] = {}
        for seqs in stage.micro_batches(sched.seqs):
            inputs = self.prepare_inputs(seqs)
            hidden_in = stage.receive(len(inputs.input_ids))
            sampled.update(stage.compute(lambda: self._run_stage(inputs, hidden_in, stage)))
        sampled = stage.finish(sampled)
        self.record(sampled)
        return ModelRunnerOutput(sampled, self._draft_proposals(sched, sampled))

    def _draft_proposals(self, sched: SchedulerOutput, sampled: dict[str, list[SampledToken]]) -> dict[str, list[int]] | None:
        """The draft model's guesses for the next step ({} when the step asks for none: they
        replace the last step's); None without a draft model."""
        if self.draft is None:
            return None
        if not sched.num_draft_tokens:
            return {}
        blocks = {seq.req_id: seq.block_ids for seq in sched.seqs}
        wanted = list(sampled)[:sched.num_draft_requests]
        return self.draft.propose([DraftRequest(r, self.states[r].token_ids, blocks[r]) for r in wanted],
                                  sched.num_draft_tokens)

    def forward(self, inputs: "StepInputs", hidden_in: torch.Tensor | None = None) -> torch.Tensor:
        """The model's output rows of one step: replayed from a decode graph where one covers it."""
        if hidden_in is None and self.graphs is not None and self.graphs.covers(inputs.meta, len(inputs.input_ids)):
            return self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
        return self.model(inputs.input_ids, inputs.positions, self.kv_cache.layers, inputs.meta, hidden_in)

    def _run_stage(self, inputs: "StepInputs", hidden_in: torch.Tensor | None, stage: "Stage") -> dict[str, list[SampledToken]]:
        hidden = self.forward(inputs, hidden_in)
        if not stage.is_last:
            stage.send(hidden)
            return {}
        if not inputs.sample_req_ids:
            return {}
        if stage.samples:
            return self.sample(inputs, hidden)
        self.model.compute_logits(hidden[inputs.sample_indices])  # the vocab-parallel head is a collective
        return {}

    def update_states(self, sched: SchedulerOutput) -> None:
        """Forget finished requests; remember new ones (their tokens and sampling state)."""
        for req_id in sched.finished_req_ids:
            self.states.pop(req_id, None)
            if self.draft is not None:
                self.draft.forget(req_id)
        for new in sched.new_requests:
            self.states[new.req_id] = SamplingState(
                new.params, new.seed, list(new.token_ids), new.num_prompt_tokens, self.eos_token_ids
            )

    def sample(self, inputs: "StepInputs", hidden: torch.Tensor) -> dict[str, list[SampledToken]]:
        """The next token of every sequence whose chunk ends at its last known token; for a chunk
        of proposals, the ones that held and the token after them."""
        if not inputs.sample_req_ids:
            return {}
        hidden = hidden[inputs.sample_indices]
        states = self._row_states(inputs)
        rows = None
        if argmax_suffices(states):  # greedy: at batch 64, 3.7 -> 2.5 ms without [64, 49k] logits
            token_ids = self.model.compute_greedy(hidden)
            if token_ids is not None:
                rows = [SampledToken(t) for t in token_ids.tolist()]
        if rows is None:
            logits = self.model.compute_logits(hidden)  # [R, vocab] float32
            # sampled where the logits are: no per-step copy of [R, vocab] to the host, one of R ids
            rows = sample(logits, states, self.grammar_masks(states))
        sampled, row = {}, 0
        for req_id, drafts in zip(inputs.sample_req_ids, inputs.sample_drafts):
            sampled[req_id] = accept_proposals(rows[row:row + 1 + len(drafts)], drafts)
            row += 1 + len(drafts)
        return sampled

    def _row_states(self, inputs: "StepInputs") -> list[SamplingState]:
        """The sampling state of each sampled row: a verified chunk's row j sees the request's
        tokens followed by its first j proposals (the position and penalties plain decoding of
        that row would have)."""
        states = []
        for req_id, drafts in zip(inputs.sample_req_ids, inputs.sample_drafts):
            state = self.states[req_id]
            states.append(state)
            states.extend(replace(state, token_ids=state.token_ids + drafts[:j]) for j in range(1, len(drafts) + 1))
        return states

    def grammar_masks(self, states: list[SamplingState]) -> torch.Tensor | None:
        """The allowed-token bitmask of each state (None when no state has a grammar). A state's
        matcher is made when it is first sampled here, replaying the output it already has."""
        rows = [i for i, s in enumerate(states) if s.params.structured_outputs is not None]
        if not rows:
            return None
        for i in rows:
            state = states[i]
            if state.matcher is None:
                state.matcher = self.grammars.matcher(state.params.structured_outputs,
                                                      state.token_ids[state.num_prompt_tokens:])
        bitmask = torch.full((len(states), bitmask_words(self.grammars.vocab_size)), -1, dtype=torch.int32)
        self.grammars.fill_masks([states[i].matcher for i in rows], rows, bitmask)
        return bitmask

    def record(self, sampled: dict[str, list[SampledToken]]) -> None:
        for req_id, tokens in sampled.items():
            state = self.states[req_id]
            for token in tokens:
                state.token_ids.append(token.token_id)
                if state.matcher is not None:
                    state.matcher.consume_token(token.token_id)

    def prepare_inputs(self, seqs: list[ScheduledSeq]) -> StepInputs:
        """Pack decodes first (one token each, longest context first), then prefill chunks; the
        attention backend builds its metadata from that packing."""
        decodes = sorted((s for s in seqs if s.num_tokens == 1), key=lambda s: -s.start_pos)
        prefills = [s for s in seqs if s.num_tokens > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        sample_indices: list[int] = []
        sample_req_ids: list[str] = []
        sample_drafts: list[list[int]] = []
        for seq in decodes + prefills:
            tokens = self.states[seq.req_id].token_ids
            num_known = seq.num_tokens - len(seq.spec_token_ids)
            positions.extend(range(seq.start_pos, seq.start_pos + seq.num_tokens))
            input_ids.extend(tokens[seq.start_pos : seq.start_pos + num_known])
            input_ids.extend(seq.spec_token_ids)
            if seq.sample:
                sample_indices.extend(range(len(input_ids) - 1 - len(seq.spec_token_ids), len(input_ids)))
                sample_req_ids.append(seq.req_id)
                sample_drafts.append(seq.spec_token_ids)
        spans = [SeqSpan(s.start_pos, s.num_tokens, s.block_ids) for s in decodes + prefills]
        meta = self.attention.build_metadata(spans, len(decodes), self.kv_cache)
        return StepInputs(self._tensor(input_ids), self._tensor(positions), meta,
                          self._tensor(sample_indices), sample_req_ids, sample_drafts)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
