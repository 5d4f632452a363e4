"""Time of the collectives the parallel layouts use: ring all-reduce, all-to-all, point-to-point."""
from __future__ import annotations


def ring_allreduce_time_s(num_bytes: float, world: int, bandwidth_bytes_s: float, latency_s: float) -> float:
    """Ring all-reduce of `num_bytes` per rank: 2 (n-1)/n * bytes / bw + 2 (n-1) * latency; 0 when n = 1."""
    if world <= 1:
        return 0.0
    return 2 * (world - 1) / world * num_bytes / bandwidth_bytes_s + 2 * (world - 1) * latency_s


def all_to_all_time_s(num_bytes: float, world: int, bandwidth_bytes_s: float, latency_s: float) -> float:
    """All-to-all where each rank holds `num_bytes` spread evenly over all ranks (its own share
    stays): (n-1)/n * bytes / bw + (n-1) * latency; 0 when n = 1."""
    if world <= 1:
        return 0.0
    return (world - 1) / world * num_bytes / bandwidth_bytes_s + (world - 1) * latency_s


def p2p_time_s(num_bytes: float, bandwidth_bytes_s: float, latency_s: float) -> float:
    """One send/recv: latency + bytes / bw."""
    return latency_s + num_bytes / bandwidth_bytes_s


def all_gather_time_s(total_bytes: float, world: int, bandwidth_bytes_s: float, latency_s: float) -> float:
    """Ring all-gather of `total_bytes` assembled on every rank (each contributes 1/n of it):
    (n-1)/n * bytes / bw + (n-1) * latency; 0 when n = 1."""
    if world <= 1:
        return 0.0
    return (world - 1) / world * total_bytes / bandwidth_bytes_s + (world - 1) * latency_s
