"""A lease: one request's place in an in-flight count, held from when it is taken to when it is
released, lowered exactly once however the request ends.

    taken     count(+1)   (Replica.lease(): the request is sent to that replica)
    released  count(-1)   the first release() only; later ones do nothing

Every path out of a request (answer, busy, failure, resume, an exception, the client gone) may
release its lease without knowing whether another path already did, so a count can neither leak
(a replica that looks busy forever) nor drop twice (a replica that looks idler than it is).
"""
from __future__ import annotations

from collections.abc import Callable


class Lease:
    __slots__ = ("_count", "released")

    def __init__(self, count: Callable[[int], None]):
        """`count(delta)` changes the count; it is called with +1 now and -1 on the first release."""
        count(1)
        self._count, self.released = count, False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._count(-1)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *_exc) -> None:
        self.release()
