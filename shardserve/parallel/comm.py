"""The collectives our layers use, as thin calls into torch.distributed that do nothing for a
group of one (so single-process code pays nothing)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from shardserve.parallel.groups import GroupInfo


def all_reduce(x: torch.Tensor, group: GroupInfo) -> torch.Tensor:
    """Sum `x` over the group, in place."""
    if group.size > 1:
        with group.stats.timed():
            dist.all_reduce(x, group=group.group)
    return x


def all_gather(x: torch.Tensor, group: GroupInfo, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order (same shape on every rank)."""
    if group.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(group.size)]
    with group.stats.timed():
        dist.all_gather(parts, x.contiguous(), group=group.group)
    return torch.cat(parts, dim=dim)


def all_gather_uneven(x: torch.Tensor, counts: list[int], group: GroupInfo) -> torch.Tensor:
    """Concatenate along dim 0 where rank r holds `counts[r]` rows (gloo has no uneven
    all_gather: pad every part to the largest, gather, trim)."""
    if group.size == 1:
        return x
    width = max(counts)
    padded = x.new_zeros((width, *x.shape[1:]))
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(group.size)]
    with group.stats.timed():
        dist.all_gather(parts, padded, group=group.group)
    return torch.cat([part[:count] for part, count in zip(parts, counts)])


def all_to_all(data: torch.Tensor, recv_splits: list[int], send_splits: list[int], group: GroupInfo) -> torch.Tensor:
    """Rank r sends rows [sum(send_splits[:q]), +send_splits[q]) of `data` to rank q and gets
    recv_splits[q] rows from each rank q, concatenated in rank order."""
    if group.size == 1:  # it sends everything to itself
        return data
    out = data.new_empty((sum(recv_splits), *data.shape[1:]))
    with group.stats.timed():
        dist.all_to_all_single(out, data.contiguous(), recv_splits, send_splits, group=group.group)
    return out


def agree_on_min(value: int, group) -> int:
    """The smallest of every rank's `value` (all ranks call this), over a gloo group."""
    box = torch.tensor([value])
    dist.all_reduce(box, op=dist.ReduceOp.MIN, group=group)
    return int(box)


def broadcast_object(obj, src: int, group):
    """Rank `src`'s `obj` (a picklable message), returned on every rank of `group`; the other
    ranks' `obj` is ignored."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def gather_objects(obj, dst: int, group) -> list | None:
    """Every rank's `obj` in rank order on rank `dst`; None on the others."""
    gathered = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    dist.gather_object(obj, gathered, dst=dst, group=group)
    return gathered


def recv(tensor: torch.Tensor, src: int) -> torch.Tensor:
    """Fill `tensor` from rank `src` (a pipeline stage's input)."""
    dist.recv(tensor, src=src)
    return tensor


def isend(tensor: torch.Tensor, dst: int):
    """Start sending `tensor` to rank `dst`; wait on the returned handle before reusing it."""
    return dist.isend(tensor, dst=dst)
