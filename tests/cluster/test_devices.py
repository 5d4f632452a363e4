"""The GPUs a cluster hands out: a replica's world_size at a time, never one device twice."""
from __future__ import annotations

from shardserve.cluster.devices import DevicePool


def test_devices_are_handed_out_whole_and_come_back():
    pool = DevicePool((0, 1, 2, 3))
    assert pool.take(2) == (0, 1) and pool.take(1) == (2,)
    assert pool.take(2) is None and pool.num_free() == 1  # a failed take takes nothing
    pool.give_back((0, 1))
    assert pool.take(3) == (0, 1, 3) and pool.num_free() == 0


def test_without_devices_nothing_is_restricted():
    pool = DevicePool(())
    assert pool.take(8) == () and pool.num_free() is None
