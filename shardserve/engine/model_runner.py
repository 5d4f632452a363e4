"""Runs one engine step on the model: turns a SchedulerOutput into packed tensors, runs the
forward pass over the paged KV cache, and samples the next token of each finished chunk."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shardserve.config import ModelConfig
from shardserve.engine.interface import ModelRunnerOutput, SampledToken, ScheduledSeq, SchedulerOutput
from shardserve.engine.kv_cache import KVCache
from shardserve.engine.sampler import SamplingState, sample
from shardserve.layers.attention import AttentionMetadata, DecodeGroup, NativeDecode, PrefillChunk, gather_ids, split_by_length
from shardserve.layers.cpu_kernels import load_argmax_rows, load_paged_decode_attention, load_silu_mul


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # [N] row of each sampling sequence's last token
    sample_req_ids: list[str]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, kv_cache: KVCache,
                 eos_token_ids: tuple[int, ...], device: torch.device):
        self.model = model
        self.model_config = model_config
        self.kv_cache = kv_cache
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.states: dict[str, SamplingState] = {}
        self.native_decode_kernel = load_paged_decode_attention() if device.type == "cpu" else None
        if device.type == "cpu":  # compiled now (then cached on disk), not while a first request waits
            load_silu_mul()
            load_argmax_rows()

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.update_states(sched)
        if sched.is_empty:
            return ModelRunnerOutput()
        inputs = self.prepare_inputs(sched.seqs)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache.layers, inputs.meta)
        sampled = self.sample(inputs, hidden)
        self.record(sampled)
        return ModelRunnerOutput(sampled)

    def update_states(self, sched: SchedulerOutput) -> None:
        """Forget finished requests; remember new ones (their tokens and sampling state)."""
        for req_id in sched.finished_req_ids:
            self.states.pop(req_id, None)
        for new in sched.new_requests:
            self.states[new.req_id] = SamplingState(
                new.params, new.seed, list(new.token_ids), new.num_prompt_tokens, self.eos_token_ids
            )

    def sample(self, inputs: "StepInputs", hidden: torch.Tensor) -> dict[str, SampledToken]:
        """The next token of every sequence whose chunk ends at its last known token."""
        if not inputs.sample_req_ids:
            return {}
        logits = self.model.compute_logits(hidden[inputs.sample_indices])  # [N, vocab] float32
        states = [self.states[r] for r in inputs.sample_req_ids]
        return dict(zip(inputs.sample_req_ids, sample(logits.cpu(), states)))

    def record(self, sampled: dict[str, SampledToken]) -> None:
        for req_id, token in sampled.items():
            self.states[req_id].token_ids.append(token.token_id)

    def prepare_inputs(self, seqs: list[ScheduledSeq]) -> StepInputs:
        """Pack decodes first (one token each, longest context first), then prefill chunks."""
        decodes = sorted((s for s in seqs if s.num_tokens == 1), key=lambda s: -s.start_pos)
        prefills = [s for s in seqs if s.num_tokens > 1]
        block_size = self.kv_cache.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_indices: list[int] = []
        sample_req_ids: list[str] = []
        for seq in decodes + prefills:
            tokens = self.states[seq.req_id].token_ids
            for pos in range(seq.start_pos, seq.start_pos + seq.num_tokens):
                slots.append(seq.block_ids[pos // block_size] * block_size + pos % block_size)
            positions.extend(range(seq.start_pos, seq.start_pos + seq.num_tokens))
            input_ids.extend(tokens[seq.start_pos : seq.start_pos + seq.num_tokens])
            if seq.sample:
                sample_indices.append(len(input_ids) - 1)
                sample_req_ids.append(seq.req_id)
        meta = AttentionMetadata(slot_mapping=self._tensor(slots))
        if decodes and self.native_decode_kernel is not None:
            meta.native_decode = self._native_decode(decodes)
        else:
            block_counts = [s.start_pos // block_size + 1 for s in decodes]
            for start, end in split_by_length(block_counts):
                meta.decode_groups.append(DecodeGroup(start, end, *self._decode_tables(decodes[start:end])))
        token_start = len(decodes)
        for seq in prefills:
            context_len = seq.start_pos + seq.num_tokens
            rows = None
            if seq.start_pos > 0:
                rows = self._gather_ids(seq.block_ids[: -(-context_len // block_size)])
            meta.prefills.append(PrefillChunk(token_start, token_start + seq.num_tokens, context_len, rows))
            token_start += seq.num_tokens
        return StepInputs(self._tensor(input_ids), self._tensor(positions), meta,
                          self._tensor(sample_indices), sample_req_ids)

    def _padded_tables(self, decodes: list[ScheduledSeq]) -> tuple[list[list[int]], list[int]]:
        """Block tables padded with block 0 to the longest context, and the context lengths."""
        context_lens = [s.start_pos + 1 for s in decodes]
        max_blocks = -(-max(context_lens) // self.kv_cache.block_size)
        tables = [s.block_ids[:max_blocks] + [0] * (max_blocks - len(s.block_ids[:max_blocks])) for s in decodes]
        return tables, context_lens

    def _decode_tables(self, decodes: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache rows of the padded block tables [KV * B * max_blocks] and the additive mask
        [KV * B, 1, max_blocks * bs] that hides the padding."""
        tables, context_lens = self._padded_tables(decodes)
        num_slots = len(tables[0]) * self.kv_cache.block_size
        visible = torch.arange(num_slots).unsqueeze(0) < torch.tensor(context_lens).unsqueeze(1)  # [B, L]
        bias = torch.zeros(visible.shape, dtype=self.kv_cache.dtype).masked_fill_(~visible, float("-inf"))
        bias = bias.unsqueeze(1).repeat(self.kv_cache.num_kv_heads, 1, 1)  # [KV * B, 1, L]
        return self._gather_ids(tables), bias.to(self.device)

    def _native_decode(self, decodes: list[ScheduledSeq]) -> NativeDecode:
        tables, context_lens = self._padded_tables(decodes)
        return NativeDecode(self.native_decode_kernel, self._tensor(tables), self._tensor(context_lens))

    def _gather_ids(self, block_ids: list) -> torch.Tensor:
        ids = torch.tensor(block_ids, dtype=torch.long).view(-1)
        return gather_ids(ids, self.kv_cache.num_kv_heads, self.kv_cache.num_blocks).to(self.device)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
