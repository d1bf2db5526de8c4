"""Where a ready revision's weights are: the plan of MinT's three residency tiers.

1. **catalog**: every registered revision is addressable (the registry); holding nothing.
2. **host cache**: verified weights in host memory, least recently used evicted first, bounded
   in bytes. A revision is ready on a worker only while it is here. The plan holds the weights
   themselves (opaque values to it), so what the table says is what the worker holds: a revision
   that does not fit is never half taken in.
3. **device slots**: a fixed number of slots beside the resident base. A request pins the slot
   of its adapter while it runs; a load takes a free slot, else the least recently used
   unpinned one. When every slot is pinned, the request waits; it never fails for it.

The tiers are inclusive: a device slot only holds a revision the host cache holds, and
evicting a revision from the host frees its (unpinned) slot too.

This module decides and keeps the host tier. `Residency` answers what to load, where, and what
that evicts; the worker carries that out (copies tensors into slots, clears them). Keys are
opaque strings (revision ids). Thread-safe: the prewarm threads, the scheduler and the HTTP
handlers share one plan.
"""

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, TypeVar

from mint_core.errors import ConfigurationError, NotReadyError

Weights = TypeVar("Weights")


class Tier(StrEnum):
    HOST = "host"
    """Host memory, bounded in bytes."""
    DEVICE = "device"
    """Device slots beside the base model."""


@dataclass
class TierCounters:
    """What happened in one tier since the worker started."""

    hits: int = 0
    """Lookups that found the revision already in this tier."""
    misses: int = 0
    """Lookups that did not."""
    loads: int = 0
    """Revisions copied into this tier."""
    evictions: int = 0
    """Revisions dropped from this tier to make room."""


@dataclass(frozen=True)
class HostEntry:
    key: str
    nbytes: int


@dataclass(frozen=True)
class SlotEntry:
    slot: int
    key: str
    pins: int
    """Requests now using the slot; a pinned slot is never evicted."""


@dataclass(frozen=True)
class SlotGrant:
    """A pinned device slot for a request: `load` says the weights must be copied in first
    (the slot held `evicted` before, or nothing)."""

    key: str
    slot: int
    load: bool
    evicted: str | None = None


@dataclass
class _Slot:
    key: str
    pins: int = 0


@dataclass(frozen=True)
class _Held(Generic[Weights]):
    weights: Weights
    nbytes: int


@dataclass
class Residency(Generic[Weights]):
    """The host cache (its contents and table) and device slot table, and the decisions that
    change them."""

    host_capacity_bytes: int
    device_slots: int
    host_capacity_entries: int | None = None
    """Most revisions the host tier holds, whatever their size (None: bytes alone bound it).
    An engine whose host cache counts adapters (vLLM's `--max-cpu-loras`) sets it."""
    _host: OrderedDict[str, _Held[Weights]] = field(default_factory=OrderedDict, init=False)
    """key -> weights and their size, least recently used first."""
    _slots: dict[int, _Slot] = field(default_factory=dict, init=False)
    _slot_use: OrderedDict[int, None] = field(default_factory=OrderedDict, init=False)
    """Occupied slots, least recently used first."""
    _leaving: set[str] = field(default_factory=set, init=False)
    """Keys `leave` was asked for while requests pinned them: they go at the last release."""
    counters: dict[Tier, TierCounters] = field(
        default_factory=lambda: {tier: TierCounters() for tier in Tier}, init=False
    )
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.host_capacity_bytes < 1:
            raise ConfigurationError(
                f"host cache capacity {self.host_capacity_bytes} bytes must be positive"
            )
        if self.device_slots < 1:
            raise ConfigurationError(f"device_slots={self.device_slots} must be at least 1")
        if self.host_capacity_entries is not None and self.host_capacity_entries < 1:
            raise ConfigurationError(
                f"host_capacity_entries={self.host_capacity_entries} must be at least 1"
            )

    # Host tier.

    def put_host(self, key: str, weights: Weights, nbytes: int) -> list[str]:
        """Take `key`'s `weights` (`nbytes` of host memory) into the host cache, evicting least
        recently used revisions that are not in a pinned slot until it fits; returns the evicted
        keys (their slots are freed too). ConfigurationError if it cannot fit even then; nothing
        is evicted or kept in that case. A key already held keeps its weights."""
        with self._lock:
            if key in self._host:
                self._host.move_to_end(key)
                self._leaving.discard(key)  # taken in again before it could leave
                return []
            victims: list[str] = []
            free = self.host_capacity_bytes - self._bytes()
            entries = self.host_capacity_entries or len(self._host) + 1
            for candidate, held in self._host.items():
                if free >= nbytes and len(self._host) - len(victims) < entries:
                    break
                if self._pins(candidate) == 0:
                    victims.append(candidate)
                    free += held.nbytes
            if len(self._host) - len(victims) >= entries:
                raise ConfigurationError(
                    f"{key} does not fit: the host cache holds at most {entries} revisions "
                    "and the others are pinned by running requests: raise MINT_HOST_ADAPTERS"
                )
            if free < nbytes:
                raise ConfigurationError(
                    f"{key} needs {nbytes} bytes of host cache; {free} can be freed of "
                    f"{self.host_capacity_bytes} (the rest is pinned by running requests): "
                    "raise the host cache capacity (MINT_HOST_CACHE_MB)"
                )
            for victim in victims:
                self._drop(victim)
                self.counters[Tier.HOST].evictions += 1
            self._host[key] = _Held(weights, nbytes)
            self.counters[Tier.HOST].loads += 1
            return victims

    def drop_host(self, key: str) -> bool:
        """Forget `key` (and its slot) unless a request pins it; True if it was dropped."""
        with self._lock:
            if key not in self._host or self._pins(key):
                return False
            self._drop(key)
            return True

    def leave(self, key: str) -> bool:
        """Forget `key` (and its slot) now, or, while requests pin it, when the last of them is
        released (no new request gets it meanwhile): what a failed or evicted revision needs,
        whose weights nobody else would ever drop. True if it left now."""
        with self._lock:
            if key not in self._host:
                return False
            if self._pins(key):
                self._leaving.add(key)
                return False
            self._drop(key)
            return True

    def in_host(self, key: str) -> bool:
        with self._lock:
            return key in self._host

    def host_weights(self, key: str) -> Weights:
        """The weights the host cache holds for `key` (to copy into the slot `acquire` pinned:
        a pinned revision stays in the host cache). NotReadyError if it holds none."""
        with self._lock:
            held = self._host.get(key)
            if held is None:
                raise NotReadyError(f"{key} is not in this worker's host cache")
            return held.weights

    # Device tier.

    def acquire(self, key: str) -> SlotGrant | None:
        """Pin a device slot for one request for `key`: the slot already holding it (a hit),
        else a free slot, else the least recently used unpinned one. None when every slot is
        pinned: the request waits. NotReadyError if the host cache does not hold `key`."""
        with self._lock:
            if key not in self._host or key in self._leaving:
                self.counters[Tier.HOST].misses += 1
                raise NotReadyError(f"{key} is not in this worker's host cache")
            slot = self._slot_of(key)
            if slot is not None:
                self.counters[Tier.DEVICE].hits += 1
                return self._pin(key, slot, load=False)
            free = next((s for s in range(1, self.device_slots + 1) if s not in self._slots), None)
            evicted = None
            if free is None:
                free = next((s for s in self._slot_use if self._slots[s].pins == 0), None)
                if free is None:
                    return None  # counted when it is granted
                evicted = self._slots.pop(free).key
                del self._slot_use[free]
                self.counters[Tier.DEVICE].evictions += 1
            # A device load reads the host copy: a host hit.
            self.counters[Tier.HOST].hits += 1
            self.counters[Tier.DEVICE].misses += 1
            self.counters[Tier.DEVICE].loads += 1
            return self._pin(key, free, load=True, evicted=evicted)

    def release(self, key: str) -> bool:
        """Unpin one use of `key`'s slot (a request finished). True if that was the last pin of
        a key `leave` was asked for: it has left both tiers now."""
        with self._lock:
            slot = self._slot_of(key)
            if slot is None or self._slots[slot].pins == 0:
                raise ConfigurationError(f"{key} holds no pinned device slot to release")
            self._slots[slot].pins -= 1
            if self._slots[slot].pins == 0 and key in self._leaving:
                self._drop(key)
                return True
            return False

    def slot_of(self, key: str) -> int | None:
        with self._lock:
            return self._slot_of(key)

    # Tables, for tests, status and metrics.

    def host_table(self) -> list[HostEntry]:
        """Host cache, least recently used first."""
        with self._lock:
            return [HostEntry(key, held.nbytes) for key, held in self._host.items()]

    def slot_table(self) -> list[SlotEntry]:
        """Occupied device slots, by slot number."""
        with self._lock:
            return [SlotEntry(s, e.key, e.pins) for s, e in sorted(self._slots.items())]

    @property
    def host_bytes(self) -> int:
        with self._lock:
            return self._bytes()

    # Internals; the caller holds the lock.

    def _bytes(self) -> int:
        return sum(held.nbytes for held in self._host.values())

    def _slot_of(self, key: str) -> int | None:
        return next((s for s, e in self._slots.items() if e.key == key), None)

    def _pins(self, key: str) -> int:
        slot = self._slot_of(key)
        return 0 if slot is None else self._slots[slot].pins

    def _pin(self, key: str, slot: int, load: bool, evicted: str | None = None) -> SlotGrant:
        self._host.move_to_end(key)
        entry = self._slots.setdefault(slot, _Slot(key))
        entry.pins += 1
        self._slot_use[slot] = None
        self._slot_use.move_to_end(slot)
        return SlotGrant(key, slot, load, evicted)

    def _drop(self, key: str) -> None:
        del self._host[key]
        self._leaving.discard(key)
        slot = self._slot_of(key)
        if slot is not None:
            del self._slots[slot]
            del self._slot_use[slot]
