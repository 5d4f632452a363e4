"""The GPUs of this host that the cluster hands out, a replica's world_size at a time, so that
replicas of different layouts never share a device. With no devices configured (CPU) every
request is granted an empty tuple: nothing is restricted."""
from __future__ import annotations


class DevicePool:
    def __init__(self, device_ids: tuple[int, ...]):
        self.managed = bool(device_ids)
        self.free = sorted(device_ids)

    def num_free(self) -> int | None:
        """Free devices, or None when devices are not managed."""
        return len(self.free) if self.managed else None

    def take(self, count: int) -> tuple[int, ...] | None:
        """`count` devices (the lowest free ids), or None if there are not enough."""
        if not self.managed:
            return ()
        if count > len(self.free):
            return None
        taken, self.free = self.free[:count], self.free[count:]
        return tuple(taken)

    def give_back(self, device_ids: tuple[int, ...]) -> None:
        self.free = sorted(set(self.free) | set(device_ids))
