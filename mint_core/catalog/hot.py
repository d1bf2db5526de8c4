"""Answers the catalog gave recently, kept as objects and read without a lock.

A request names a revision (`name`, `name@alias`, `name:rN`); answering it from the index costs
a query and decoding the policy record (tens of µs, the decoding with the GIL held), so the
answers to recent questions are kept here, keyed by the question (a tuple of strings and
numbers: hashed and compared in C, so each dict operation is atomic under the GIL), and read
with a plain dict lookup: many threads read at once and never wait on one another or on a sync.

Nothing kept is answered stale after a sync returns: each answer is kept with its adapter's
version as it was *before* the index was read, and a sync, after its writes are committed,
moves the version of every adapter it changed (`invalidate`). An answer read from the index
before that commit then carries the old version and is never returned; one read after it
carries the new. Dropping everything swaps in a new dict, so an answer still being computed
lands in a dict nobody reads.

At most `capacity` answers are kept; each new one pushes out the oldest kept (first in, first
out). One in, one out: the garbage collector sees no growth once the map is full, whereas
dropping many answers at once makes it run (and walk the whole heap) while the map refills.
"""

import threading
from collections import deque
from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

V = TypeVar("V")

_Store = tuple[dict[Hashable, tuple[V, int]], deque[Hashable]]


class HotMap(Generic[V]):
    """Recent answers by question, each valid while its adapter has not changed."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._store: _Store[V] = ({}, deque())
        """The answers and their keys, oldest first: replaced together, whole."""
        self._versions: dict[str, int] = {}
        """Adapter -> how many times a sync changed it (absent: never)."""
        self._changing = threading.Lock()

    def get(self, adapter: str, key: Hashable) -> V | None:
        """The answer kept for `key` (a question about `adapter`), if it is still valid."""
        entry = self._store[0].get(key)
        if entry is None or entry[1] != self._versions.get(adapter, 0):
            return None
        return entry[0]

    def stamp(self, adapter: str) -> tuple[_Store[V], int]:
        """Take this before reading the index for an answer about `adapter`, then `put` the
        answer with it: the order is what keeps a stale answer out."""
        return self._store, self._versions.get(adapter, 0)

    def put(self, stamp: tuple[_Store[V], int], key: Hashable, value: V) -> None:
        (answers, order), version = stamp
        if key not in answers:
            order.append(key)
        answers[key] = (value, version)
        while len(answers) > self.capacity:
            try:
                answers.pop(order.popleft(), None)
            except IndexError:  # emptied by other threads meanwhile
                return

    def invalidate(self, adapters: Iterable[str] | None = None) -> None:
        """Forget what was kept about `adapters` (None: everything). Call after the change is
        committed to the index."""
        with self._changing:  # two syncs at once: neither's increment is lost
            if adapters is None:
                # Every answer is gone, and in-flight ones land in the dropped dict. (The
                # versions stay: an answer stamped across the swap still carries an old one.)
                self._store = ({}, deque())
                return
            versions = self._versions
            for adapter in adapters:
                versions[adapter] = versions.get(adapter, 0) + 1

    def __len__(self) -> int:
        return len(self._store[0])
