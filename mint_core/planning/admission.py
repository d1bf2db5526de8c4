"""Which revisions a worker prewarms next: at most K at once, rollbacks first, then demand.

A new revision's first load is slow and competes with running requests for the machine, so a
worker prewarms only a few at a time (K, default 1) and queues the rest. A rollback jumps the
queue: it is the fix for something already hurting users. A revision a request is waiting for
(demand) comes next: a client was told to come back in a moment. Within a priority, first come
first served. This module only decides; the worker's prewarm threads carry it out.
"""

from collections.abc import Hashable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Generic, TypeVar

from mint_core.config import MintConfig
from mint_core.errors import ConfigurationError

DEFAULT_CONCURRENCY = MintConfig.admission_k
Key = TypeVar("Key", bound=Hashable)


class Priority(IntEnum):
    """Lower goes first."""

    ROLLBACK = 0
    """Re-activating an earlier revision."""
    DEMAND = 1
    """A revision a request asked for while it was ready nowhere."""
    NORMAL = 2
    """A new revision, or one the registry pins here."""
    PREFILL = 3
    """A production revision placed on this worker, taking host room nobody asked for: last in
    line, and once ready it keeps no room from a revision a request wants (not held fresh:
    `Residency.settle`)."""


@dataclass
class AdmissionQueue(Generic[Key]):
    """Queued and prewarming revisions of one worker."""

    concurrency: int = DEFAULT_CONCURRENCY
    _queued: list[tuple[Priority, int, Key]] = field(default_factory=list, init=False)
    """(priority, arrival, key), in the order they will start."""
    _prewarming: dict[Key, Priority] = field(default_factory=dict, init=False)
    """Key -> the priority it started at."""
    _arrivals: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ConfigurationError(
                f"admission concurrency {self.concurrency} must be at least 1 (MINT_ADMISSION_K)"
            )

    def push(self, key: Key, priority: Priority = Priority.NORMAL) -> bool:
        """Queue `key`; False if it is already queued or prewarming. Queuing it again with a
        higher priority moves it up (or, once prewarming, counts as what it started at: a
        prefill a request now waits for is held fresh when ready)."""
        if key in self._prewarming:
            self._prewarming[key] = min(self._prewarming[key], priority)
            return False
        existing = next((q for q in self._queued if q[2] == key), None)
        if existing is not None:
            if priority >= existing[0]:
                return False
            self._queued.remove(existing)
        self._queued.append((priority, self._arrivals, key))
        self._arrivals += 1
        # Arrivals are unique, so the sort never compares keys.
        self._queued.sort(key=lambda q: (q[0], q[1]))
        return True

    def start_next(self) -> Key | None:
        """The next revision to prewarm, if fewer than K are prewarming; it counts as
        prewarming until `finish`."""
        if not self._queued or len(self._prewarming) >= self.concurrency:
            return None
        priority, _, key = self._queued.pop(0)
        self._prewarming[key] = priority
        return key

    def started_as(self, key: Key) -> Priority | None:
        """The priority `key` started prewarming at; None if it is not prewarming."""
        return self._prewarming.get(key)

    def finish(self, key: Key) -> None:
        self._prewarming.pop(key, None)

    def position(self, key: Key) -> int | None:
        """0 for the next to start; None if `key` is not waiting."""
        return next((i for i, (_, _, k) in enumerate(self._queued) if k == key), None)

    def __len__(self) -> int:
        """Revisions queued or prewarming."""
        return len(self._queued) + len(self._prewarming)

    @property
    def prewarming(self) -> frozenset[Key]:
        return frozenset(self._prewarming)

    @property
    def waiting(self) -> list[Key]:
        return [key for _, _, key in self._queued]
