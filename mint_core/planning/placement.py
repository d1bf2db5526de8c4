"""Which workers of a base hold a revision (its placement), and how many (its demand).

**Placement** is rendezvous (highest-random-weight) hashing: every worker of the revision's base
gets a score from a hash of (worker, revision), and the revision is placed on the `replicas`
highest. It is a pure function of the revision and the set of live workers, so every gateway,
every worker and the release pipeline work out the same placement without talking to each other;
when a worker joins, it takes over only the revisions it now outranks every other worker for
(about 1/N of them), and when one leaves, only its own revisions move (each to its next-ranked
worker).

**Demand** turns traffic into replicas: a revision's request rate (decayed exponentially, so it
follows the last `half_life_s` or so) and its requests in flight. A revision whose rate per
replica goes above `hot_rate` (or whose requests in flight per replica go above `hot_in_flight`)
gets one more replica, up to the number of workers; one that cools to half that loses one. The
revision's extra replicas are its next-ranked workers, so growing and shrinking move nothing else.

Pure (no I/O, no threads): the gateway, the workers and `bench/tiers_sim.py` drive the same code.
"""

import hashlib
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from mint_core.errors import ConfigurationError

_MASK = (1 << 64) - 1


@lru_cache(maxsize=65536)
def _hash(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def _mix(value: int) -> int:
    """splitmix64's finaliser: spreads the bits of (revision hash ^ worker hash) so that each
    worker's score for a revision is independent of the others'."""
    value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    value = (value ^ (value >> 27)) * 0x94D049BB133111EB & _MASK
    return value ^ (value >> 31)


def ranking(revision: str, workers: Sequence[str]) -> list[str]:
    """`workers` in the order `revision` prefers them: its placement is the first `replicas`,
    the next one takes over if one of those leaves. Workers are named as the fleet names them
    (their URLs); the order of `workers` does not matter."""
    key = _hash(revision)
    return sorted(workers, key=lambda worker: (_mix(key ^ _hash(worker)), worker), reverse=True)


def place(revision: str, workers: Sequence[str], replicas: int = 1) -> tuple[str, ...]:
    """The workers that hold `revision`: the `replicas` it ranks highest of `workers` (all of
    them if there are fewer)."""
    if replicas < 1:
        raise ConfigurationError(f"replicas={replicas} must be at least 1 (MINT_REPLICAS)")
    if replicas == 1 and workers:  # the common case, without sorting
        key = _hash(revision)
        return (max(workers, key=lambda worker: (_mix(key ^ _hash(worker)), worker)),)
    return tuple(ranking(revision, workers)[:replicas])


@dataclass
class _Heat:
    rate: float = 0.0
    """Requests per second, decayed to `at`."""
    at: float = 0.0
    in_flight: int = 0
    extra: int = 0
    """Replicas above the revision's own setting, given by demand."""


@dataclass
class Demand:
    """Each revision's recent request rate and requests in flight, and so its replicas. Keeps
    the `tracked` most recently requested revisions (a revision not seen for long has cooled
    to nothing anyway)."""

    hot_rate: float
    """Requests per second per replica above which a revision gets another replica."""
    hot_in_flight: int = 8
    """Requests in flight per replica above which it does too."""
    half_life_s: float = 10.0
    """How fast the rate forgets: a burst counts half as much this long after."""
    tracked: int = 100_000
    clock: Callable[[], float] = field(default=lambda: 0.0, repr=False)
    """Seconds, monotonic (the caller's: the real clock, or a simulation's)."""
    _heat: OrderedDict[str, _Heat] = field(default_factory=OrderedDict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.hot_rate <= 0:
            raise ConfigurationError(f"hot_rate={self.hot_rate} must be positive (MINT_HOT_RATE)")
        if self.half_life_s <= 0:
            raise ConfigurationError(f"half_life_s={self.half_life_s} must be positive")

    def started(self, revision: str) -> None:
        """A request for `revision` arrived (and is in flight until `finished`)."""
        heat = self._touch(revision)
        # A decayed count of requests over the last half-lives, as a rate: the count's
        # steady state under a constant rate r is r * half_life / ln 2.
        heat.rate += math.log(2) / self.half_life_s
        heat.in_flight += 1

    def finished(self, revision: str) -> None:
        heat = self._heat.get(revision)
        if heat is not None and heat.in_flight > 0:
            heat.in_flight -= 1

    def rate(self, revision: str) -> float:
        """Requests per second, recently."""
        heat = self._heat.get(revision)
        return 0.0 if heat is None else self._decayed(heat)

    def replicas(self, revision: str, own: int, workers: int) -> int:
        """How many workers should hold `revision` now: its own setting `own`, plus what its
        demand adds, at most `workers`. Grows by one when each replica is over the hot rate
        (or in-flight count), shrinks by one once the replicas left would each be under half
        of it (so a revision at the threshold does not flap)."""
        heat = self._heat.get(revision)
        if heat is None:
            return min(own, workers)
        rate = self._decayed(heat)
        current = own + heat.extra

        def hot(replicas: int, share: float) -> bool:
            return rate > share * self.hot_rate * replicas or (
                heat.in_flight > share * self.hot_in_flight * replicas
            )

        if hot(current, 1.0) and current < workers:
            heat.extra += 1
        elif heat.extra > 0 and not hot(current - 1, 0.5):
            heat.extra -= 1
        return max(1, min(own + heat.extra, workers))

    def _touch(self, revision: str) -> _Heat:
        heat = self._heat.get(revision)
        if heat is None:
            heat = self._heat[revision] = _Heat(at=self.clock())
            if len(self._heat) > self.tracked:
                self._heat.popitem(last=False)
        else:
            self._heat.move_to_end(revision)
        heat.rate = self._decayed(heat)
        heat.at = self.clock()
        return heat

    def _decayed(self, heat: _Heat) -> float:
        elapsed = max(0.0, self.clock() - heat.at)
        return heat.rate * 0.5 ** (elapsed / self.half_life_s)
