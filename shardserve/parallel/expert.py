"""Expert parallelism: where each expert lives, and moving tokens to it and back.

Every rank of a stage holds `slots_per_rank` expert slots. A placement says which logical
expert each slot holds; a hot expert may sit in several slots (replicas), and its tokens are
spread over them. The initial placement is contiguous (rank r: experts [r E/ep, (r+1) E/ep))
plus redundant slots; `balanced_placement` recomputes it from observed load, in the spirit of
DeepSeek's EPLB: give replicas to the experts with most load per replica, then pack replicas
onto ranks heaviest first.

One MoE layer, ep ranks, every rank holding the same T tokens (attention output is replicated
across the stage):

    rank r: its chunk of tokens x[c_r : c_r+1]  [t, H] -> router -> (expert, weight) x k per token
      pick a replica per (token, expert) pair -> destination rank and slot
      all_to_all_single(counts)                 how many rows each rank sends each other rank
      all_to_all_single(rows [n, H], slots)     rows go to the rank holding their expert
      run the local experts on received rows    [m, H]
      all_to_all_single(results)                back to where they came from  [n, H]
      weight and sum per token                  [t, H]
    all_gather of the chunks (uneven)           [T, H] on every rank again
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shardserve.layers.experts import Experts, route
from shardserve.parallel.comm import all_gather_uneven, all_to_all
from shardserve.parallel.groups import GroupInfo

Placement = tuple[tuple[int, ...], ...]  # [rank][slot] -> logical expert id


def initial_placement(num_experts: int, num_ranks: int, num_redundant: int) -> Placement:
    """Contiguous experts per rank; redundant slots replicate the next rank's experts."""
    per_rank = num_experts // num_ranks
    placement = []
    for rank in range(num_ranks):
        own = list(range(rank * per_rank, (rank + 1) * per_rank))
        neighbour = (rank + 1) % num_ranks
        extra = [neighbour * per_rank + j % per_rank for j in range(num_redundant)]
        placement.append(tuple(own + extra))
    return tuple(placement)


def balanced_placement(loads: list[float], num_ranks: int, slots_per_rank: int) -> Placement:
    """A placement for per-expert `loads` (tokens routed to each): every expert at least once,
    spare slots as replicas (at most one per rank) of the experts with the highest load per
    replica, replicas packed
    heaviest first onto the least-loaded rank that has a free slot and no copy of that expert."""
    num_experts = len(loads)
    num_replicas = [1] * num_experts
    for _ in range(num_ranks * slots_per_rank - num_experts):
        # more copies than ranks would put two on one rank, which balances nothing
        candidates = [e for e in range(num_experts) if num_replicas[e] < num_ranks] or range(num_experts)
        hottest = max(candidates, key=lambda e: loads[e] / num_replicas[e])
        num_replicas[hottest] += 1
    replicas = sorted(((loads[e] / num_replicas[e], e) for e in range(num_experts) for _ in range(num_replicas[e])),
                      key=lambda item: (-item[0], item[1]))
    slots: list[list[int]] = [[] for _ in range(num_ranks)]
    rank_load = [0.0] * num_ranks
    for load, expert in replicas:
        free = [r for r in range(num_ranks) if len(slots[r]) < slots_per_rank]
        fresh = [r for r in free if expert not in slots[r]] or free
        rank = min(fresh, key=lambda r: (rank_load[r], r))
        slots[rank].append(expert)
        rank_load[rank] += load
    return tuple(tuple(s) for s in slots)


def rank_loads(placement: Placement, expert_loads: list[float]) -> list[float]:
    """Load per rank when each expert's tokens split evenly over its replicas."""
    copies = [0] * len(expert_loads)
    for slots in placement:
        for expert in slots:
            copies[expert] += 1
    return [sum(expert_loads[e] / copies[e] for e in slots) for slots in placement]


@dataclass
class ExpertLoadReport:
    """The replica's expert load since the last rebalance, per MoE layer (global layer id):
    `routed[layer][e]` tokens chose expert e; `processed[layer][r]` rows rank r of the layer's
    stage computed (one entry per rank, in rank order)."""

    routed: dict[int, list[int]]
    processed: dict[int, list[int]]

    @classmethod
    def from_ranks(cls, reports: list[dict[int, tuple[list[int], int, bool]]]) -> "ExpertLoadReport":
        """Combine every rank's `moe.expert_load` (in rank order). An expert-parallel layer's
        ranks each route their own chunk of tokens, so their counts add up; without ep every
        rank routes all tokens, and one rank's counts are the layer's."""
        routed: dict[int, list[int]] = {}
        processed: dict[int, list[int]] = {}
        for report in reports:
            for layer, (counts, rows, is_ep) in report.items():
                if layer not in routed:
                    routed[layer] = list(counts)
                elif is_ep:
                    routed[layer] = [a + b for a, b in zip(routed[layer], counts)]
                processed.setdefault(layer, []).append(rows)
        return cls(routed, processed)

    def imbalance(self, layer: int) -> float:
        """max / mean of the rows each rank computed (1.0: perfectly even)."""
        rows = self.processed[layer]
        mean = sum(rows) / len(rows)
        return max(rows) / mean if mean else 1.0


@dataclass
class ExpertLoadCounter:
    """Tokens routed to each logical expert (from this rank's chunk) and rows this rank's slots
    processed, since the last reset."""

    routed: torch.Tensor  # [E] int64
    processed: int = 0

    def reset(self) -> None:
        self.routed.zero_()
        self.processed = 0


@dataclass
class ExpertParallel:
    """Dispatch and combine for one MoE layer's experts spread over the `ep` group."""

    ep: GroupInfo
    placement: Placement
    # where the routing tables live: the model's device (default: the one the model is built under)
    device: torch.device = field(default_factory=torch.get_default_device)

    def __post_init__(self) -> None:
        self.num_experts = 1 + max(e for slots in self.placement for e in slots)
        self._index_replicas()

    @property
    def slots_per_rank(self) -> int:
        return len(self.placement[0])

    def _index_replicas(self) -> None:
        """replica_table [E, max_copies]: global slot ids (rank * slots_per_rank + slot) of each
        expert's replicas, padded by repeating; num_copies [E]."""
        replicas: list[list[int]] = [[] for _ in range(self.num_experts)]
        for rank, slots in enumerate(self.placement):
            for slot, expert in enumerate(slots):
                replicas[expert].append(rank * self.slots_per_rank + slot)
        width = max(len(r) for r in replicas)
        self.num_copies = torch.tensor([len(r) for r in replicas], device=self.device)
        self.replica_table = torch.tensor([r + r[:1] * (width - len(r)) for r in replicas], device=self.device)

    def local_expert_ids(self) -> list[int]:
        return list(self.placement[self.ep.rank])

    def chunk_bounds(self, num_tokens: int) -> list[int]:
        """Token offsets of each rank's chunk: rank r dispatches tokens [b[r], b[r+1])."""
        return [num_tokens * r // self.ep.size for r in range(self.ep.size + 1)]

    def forward(self, x: torch.Tensor, router, experts: Experts, top_k: int, normalize: bool,
                load: ExpertLoadCounter) -> torch.Tensor:
        """x [T, H], the same on every rank of the group -> routed experts' output [T, H]."""
        bounds = self.chunk_bounds(x.shape[0])
        lo, hi = bounds[self.ep.rank], bounds[self.ep.rank + 1]
        chunk = x[lo:hi]  # [t, H]
        weights, expert_ids = route(router(chunk), top_k, normalize)  # [t, k] each
        load.routed += torch.bincount(expert_ids.flatten(), minlength=self.num_experts)
        # one replica per (token, choice) pair, alternating between replicas by token index
        token_index = torch.arange(lo, hi, device=x.device).unsqueeze(1).expand_as(expert_ids)  # [t, k]
        copy = token_index % self.num_copies[expert_ids]
        target = self.replica_table[expert_ids, copy].flatten()  # [t*k] global slot ids
        order = target.argsort(stable=True)  # pairs grouped by destination rank
        dest_rank, dest_slot = target[order] // self.slots_per_rank, target[order] % self.slots_per_rank
        send_counts = torch.bincount(dest_rank, minlength=self.ep.size)  # [ep]
        ones = [1] * self.ep.size
        send_splits = send_counts.tolist()
        recv_splits = all_to_all(send_counts, ones, ones, self.ep).tolist()  # the counts go first
        pair_token = order // top_k  # [n] row of `chunk` for each sent pair
        rows = all_to_all(chunk.index_select(0, pair_token), recv_splits, send_splits, self.ep)  # [m, H]
        slots = all_to_all(dest_slot, recv_splits, send_splits, self.ep)  # [m]
        load.processed += len(slots)
        results = all_to_all(experts.run_slots(rows, slots), send_splits, recv_splits, self.ep)  # [n, H]
        out = torch.zeros(chunk.shape, dtype=torch.float32, device=x.device)  # [t, H]
        out.index_add_(0, pair_token, results.float() * weights.flatten()[order].unsqueeze(1))
        return all_gather_uneven(out.to(x.dtype), [b - a for a, b in zip(bounds, bounds[1:])], self.ep)


def apply_placement(ep_layer: ExpertParallel, experts: Experts, new: Placement) -> None:
    """Move expert weights so that this rank's slots hold `new[ep.rank]`, at runtime. Every rank
    of the group calls this with the same `new`. A slot whose expert this rank already held is
    copied locally; any other gets the expert from its first holder in the old placement, by
    point-to-point transfer (each rank knows the whole plan, so sends and receives pair up)."""
    old, ep, me = ep_layer.placement, ep_layer.ep, ep_layer.ep.rank
    width = ep_layer.slots_per_rank
    source: dict[int, tuple[int, int]] = {}  # expert -> (rank, slot) that sends it
    for rank, slots in enumerate(old):
        for slot, expert in enumerate(slots):
            source.setdefault(expert, (rank, slot))
    gate_up, down = torch.empty_like(experts.gate_up), torch.empty_like(experts.down)
    transfers = []
    for rank, slots in enumerate(new):
        for slot, expert in enumerate(slots):
            src_rank, src_slot = source[expert]
            tag = 2 * (rank * width + slot)
            if rank == me and expert in old[me]:
                held = old[me].index(expert)
                gate_up[slot].copy_(experts.gate_up[held])
                down[slot].copy_(experts.down[held])
            elif rank == me:
                transfers += [dist.irecv(gate_up[slot], ep.ranks[src_rank], tag=tag),
                              dist.irecv(down[slot], ep.ranks[src_rank], tag=tag + 1)]
            elif src_rank == me and expert not in old[rank]:
                transfers += [dist.isend(experts.gate_up[src_slot].contiguous(), ep.ranks[rank], tag=tag),
                              dist.isend(experts.down[src_slot].contiguous(), ep.ranks[rank], tag=tag + 1)]
    for transfer in transfers:
        transfer.wait()
    experts.gate_up.data, experts.down.data = gate_up, down
    experts.local_slots = {expert: slot for slot, expert in reversed(list(enumerate(new[me])))}
    ep_layer.placement = new
    ep_layer._index_replicas()


def rebalance(ep_layer: ExpertParallel, experts: Experts, load: ExpertLoadCounter) -> Placement:
    """Recompute this layer's placement from the load observed since the last reset (summed over
    the group), apply it, and reset the counters. Returns the new placement."""
    routed = load.routed.clone()
    dist.all_reduce(routed, group=ep_layer.ep.group)
    new = balanced_placement([float(v) for v in routed], ep_layer.ep.size, ep_layer.slots_per_rank)
    apply_placement(ep_layer, experts, new)
    load.reset()
    return new
