"""A lease raises its count when taken and lowers it exactly once, however often it is released."""
from __future__ import annotations

import pytest

from shardserve.router.lease import Lease
from shardserve.router.replica_pool import Replica


def test_a_lease_counts_once_each_way():
    deltas: list[int] = []
    lease = Lease(deltas.append)
    assert deltas == [1] and not lease.released
    lease.release()
    lease.release()
    assert deltas == [1, -1] and lease.released


def test_a_lease_as_a_context_manager_is_released_on_an_exception():
    replica = Replica("http://r0")
    with pytest.raises(RuntimeError):
        with replica.lease():
            assert replica.outstanding == 1
            raise RuntimeError("the request broke")
    assert replica.outstanding == 0


def test_leases_on_one_replica_are_independent():
    replica = Replica("http://r0")
    a, b = replica.lease(), replica.lease()
    a.release()
    a.release()
    assert replica.outstanding == 1
    b.release()
    assert replica.outstanding == 0
