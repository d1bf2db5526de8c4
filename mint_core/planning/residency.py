"""Where a ready revision's weights are: the plan of MinT's three residency tiers (catalog, host
cache, device slots), kept in one table so that what the plan says is what the worker holds.

`Residency` decides and keeps the host tier: it holds the weights themselves (opaque values to
it), answers what to load, where, and what that evicts (LRFU), and refuses a revision that does
not fit (`HostTierFull`), with nothing moved; the worker carries the plan out (copies tensors
into slots, clears them). Keys are opaque strings (revision ids). Thread-safe: the prewarm
threads, the scheduler and the HTTP handlers share one plan. The clock is the caller's (a
simulation drives the same plan). The tiers, and which revision leaves when room is needed:
the README, "Running the pieces" and "Many adapters, many workers".
"""

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
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


class HostTierFull(NotReadyError):
    """Every revision in the host tier is serving, warming, fresh or protected: nothing can
    leave for a new one now. Not the new revision's fault: it can be admitted again later."""


@dataclass
class _Held(Generic[Weights]):
    weights: Weights
    nbytes: int
    score: float
    """The LRFU score as of `used`."""
    used: float
    """The clock's time of the last use (or of the load)."""


DEFAULT_HALF_LIFE_S = 300.0
"""How long it takes a use to count half as much in the host tier's LRFU score: long enough
that a steadily used revision outranks a burst of one-off ones, short enough that yesterday's
favourite gives way."""
FRESH_S = 10.0
"""How long a revision just made ready waits for the request that brought it (a client told to
retry after a moment) before it may be evicted unused."""


@dataclass
class Residency(Generic[Weights]):
    """The host cache (its contents and table) and device slot table, and the decisions that
    change them."""

    host_capacity_bytes: int
    device_slots: int
    host_capacity_entries: int | None = None
    """Most revisions the host tier holds, whatever their size (None: bytes alone bound it)."""
    half_life_s: float = DEFAULT_HALF_LIFE_S
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    _host: OrderedDict[str, _Held[Weights]] = field(default_factory=OrderedDict, init=False)
    """key -> weights, size and score, least recently used first."""
    _slots: dict[int, _Slot] = field(default_factory=dict, init=False)
    _slot_by_key: dict[str, int] = field(default_factory=dict, init=False)
    _slot_use: OrderedDict[int, None] = field(default_factory=OrderedDict, init=False)
    """Occupied slots, least recently used first."""
    _leaving: set[str] = field(default_factory=set, init=False)
    """Keys `leave` was asked for while requests pinned them: they go at the last release."""
    _warming: set[str] = field(default_factory=set, init=False)
    """Keys taken in and not yet `settle`d."""
    _fresh: dict[str, float] = field(default_factory=dict, init=False)
    """Keys settled and not used since -> when they settled."""
    _protected: frozenset[str] = field(default=frozenset(), init=False)
    _holds: dict[str, int] = field(default_factory=dict, init=False)
    """Key -> requests using it without a device slot here (an engine with slots of its own,
    vLLM): like a pin, it keeps the revision in the host tier."""
    _bytes: int = field(default=0, init=False)
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
        """Take `key`'s `weights` (`nbytes` of host memory) into the host cache, warming until
        `settle`; returns the keys evicted to make room (lowest score first; their slots are
        freed too). ConfigurationError if it could never fit (larger than the whole cache),
        HostTierFull if it cannot now; nothing is evicted or kept in either case. A key already
        held keeps its weights."""
        with self._lock:
            if key in self._host:
                self._use(key)
                self._leaving.discard(key)  # taken in again before it could leave
                return []
            if nbytes > self.host_capacity_bytes:
                raise ConfigurationError(
                    f"{key} needs {nbytes} bytes of host cache, more than all of it "
                    f"({self.host_capacity_bytes}): raise the host cache capacity "
                    "(MINT_HOST_CACHE_MB)"
                )
            entries = self.host_capacity_entries or len(self._host) + 1
            free = self.host_capacity_bytes - self._bytes
            victims: list[str] = []
            candidates = iter(self._eviction_order())
            while free < nbytes or len(self._host) - len(victims) >= entries:
                victim = next(candidates, None)
                if victim is None:
                    raise HostTierFull(
                        f"{key} does not fit in the host cache now ({len(self._host)} of "
                        f"{entries} revisions, {self._bytes} of {self.host_capacity_bytes} "
                        "bytes) and every revision in it is serving, warming or pinned: it is "
                        "admitted again once one can leave (or raise MINT_HOST_ADAPTERS, "
                        "MINT_HOST_CACHE_MB)"
                    )
                victims.append(victim)
                free += self._host[victim].nbytes
            for victim in victims:
                self._drop(victim)
                self.counters[Tier.HOST].evictions += 1
            self._host[key] = _Held(weights, nbytes, 1.0, self.clock())
            self._bytes += nbytes
            self._warming.add(key)
            self.counters[Tier.HOST].loads += 1
            return victims

    def settle(self, key: str, fresh: bool = True) -> None:
        """`key` is ready (or gave up): it no longer counts as warming and, if `fresh` (a
        request or a roll-out waits for it), waits `FRESH_S` at most for its first use before
        it may be evicted."""
        with self._lock:
            if key in self._warming:
                self._warming.discard(key)
                if fresh:
                    self._fresh[key] = self.clock()

    def protect(self, keys: Iterable[str]) -> None:
        """Never evict these keys (the worker's pins) while they are held; replaces the last
        set given."""
        with self._lock:
            self._protected = frozenset(keys)

    def room(self) -> int:
        """Revisions the host tier can take without evicting any (bytes permitting)."""
        with self._lock:
            if self.host_capacity_entries is None:
                return 1 if self._bytes < self.host_capacity_bytes else 0
            return max(0, self.host_capacity_entries - len(self._host))

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

    def acquire(self, key: str, use: bool = True) -> SlotGrant | None:
        """Pin a device slot for one request for `key`: the slot already holding it (a hit),
        else a free slot, else the least recently used unpinned one. None when every slot is
        pinned: the request waits. NotReadyError if the host cache does not hold `key`. `use`
        False (a warm-up's own generation): not a use of the revision, for the host tier's
        score."""
        with self._lock:
            if key not in self._host or key in self._leaving:
                self.counters[Tier.HOST].misses += 1
                raise NotReadyError(f"{key} is not in this worker's host cache")
            slot = self._slot_by_key.get(key)
            if slot is not None:
                self.counters[Tier.DEVICE].hits += 1
                return self._pin(key, slot, use, load=False)
            free = next((s for s in range(1, self.device_slots + 1) if s not in self._slots), None)
            evicted = None
            if free is None:
                free = next((s for s in self._slot_use if self._slots[s].pins == 0), None)
                if free is None:
                    return None  # counted when it is granted
                evicted = self._slots.pop(free).key
                del self._slot_by_key[evicted]
                del self._slot_use[free]
                self.counters[Tier.DEVICE].evictions += 1
            # A device load reads the host copy: a host hit.
            self.counters[Tier.HOST].hits += 1
            self.counters[Tier.DEVICE].misses += 1
            self.counters[Tier.DEVICE].loads += 1
            return self._pin(key, free, use, load=True, evicted=evicted)

    def release(self, key: str) -> bool:
        """Unpin one use of `key`'s slot (a request finished). True if that was the last pin of
        a key `leave` was asked for: it has left both tiers now."""
        with self._lock:
            slot = self._slot_by_key.get(key)
            if slot is None or self._slots[slot].pins == 0:
                raise ConfigurationError(f"{key} holds no pinned device slot to release")
            self._slots[slot].pins -= 1
            if self._pins(key) == 0 and key in self._leaving:
                self._drop(key)
                return True
            return False

    def slot_of(self, key: str) -> int | None:
        with self._lock:
            return self._slot_by_key.get(key)

    def hold(self, key: str, use: bool = True) -> None:
        """A request uses `key` on an engine that keeps its own device slots (vLLM): it stays
        in the host tier until `unhold`. NotReadyError if the host cache does not hold it."""
        with self._lock:
            if key not in self._host or key in self._leaving:
                self.counters[Tier.HOST].misses += 1
                raise NotReadyError(f"{key} is not in this worker's host cache")
            self.counters[Tier.HOST].hits += 1
            self._holds[key] = self._holds.get(key, 0) + 1
            if use:
                self._use(key)

    def unhold(self, key: str) -> bool:
        """The request `hold` counted finished. True if that was the last use of a key `leave`
        was asked for: it has left the host tier now."""
        with self._lock:
            held = self._holds.get(key, 0)
            if held == 0:
                raise ConfigurationError(f"{key} is not held by a request")
            if held == 1:
                del self._holds[key]
            else:
                self._holds[key] = held - 1
            if held == 1 and key in self._leaving and self._pins(key) == 0:
                self._drop(key)
                return True
            return False

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
            return self._bytes

    @property
    def host_revisions(self) -> int:
        with self._lock:
            return len(self._host)

    # Internals; the caller holds the lock.

    def _eviction_order(self) -> list[str]:
        """The keys that may leave the host tier now, the first to go first."""
        now = self.clock()
        expired = [key for key, since in self._fresh.items() if now - since >= FRESH_S]
        for key in expired:
            del self._fresh[key]
        movable = [
            (held.score * 0.5 ** ((now - held.used) / self.half_life_s), held.used, key)
            for key, held in self._host.items()
            if key not in self._warming
            and key not in self._fresh
            and key not in self._protected
            and self._pins(key) == 0
        ]
        return [key for _, _, key in sorted(movable)]

    def _use(self, key: str) -> None:
        """A use of `key`: its score, its place in the recency order."""
        held = self._host[key]
        now = self.clock()
        held.score = held.score * 0.5 ** ((now - held.used) / self.half_life_s) + 1.0
        held.used = now
        self._host.move_to_end(key)
        self._fresh.pop(key, None)

    def _pins(self, key: str) -> int:
        slot = self._slot_by_key.get(key)
        return self._holds.get(key, 0) + (0 if slot is None else self._slots[slot].pins)

    def _pin(
        self, key: str, slot: int, use: bool, load: bool, evicted: str | None = None
    ) -> SlotGrant:
        if use:
            self._use(key)
        entry = self._slots.setdefault(slot, _Slot(key))
        self._slot_by_key[key] = slot
        entry.pins += 1
        self._slot_use[slot] = None
        self._slot_use.move_to_end(slot)
        return SlotGrant(key, slot, load, evicted)

    def _drop(self, key: str) -> None:
        self._bytes -= self._host.pop(key).nbytes
        self._leaving.discard(key)
        self._warming.discard(key)
        self._fresh.pop(key, None)
        slot = self._slot_by_key.pop(key, None)
        if slot is not None:
            del self._slots[slot]
            del self._slot_use[slot]
