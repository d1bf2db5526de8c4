"""Teams sharing a fleet: each principal's terms (a weight, a quota), the limits that enforce
quotas, and the fair order in which waiting requests join a running batch, so that one team's
burst neither starves another's requests nor spends past what it was granted. The tenancy
file's format is in the README ("Teams sharing a fleet").
"""

import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from pathlib import Path
from typing import Generic, TypeVar

from mint_core.errors import ConfigurationError, RateLimitedError

log = logging.getLogger(__name__)

BURST_S = 2.0
"""A bucket holds this many seconds of its rate (a requests bucket at least one request): short
enough that a quota holds over a minute within a few percent, long enough for a burst of a
couple of requests."""
RELOAD_S = 1.0
"""How often a service looks at the tenancy file's modification time."""
CONCURRENT_RETRY_S = 1.0
"""Retry-After for a principal at its `concurrent` limit: when one of its requests will end is
not known; a second is a typical answer's time."""

Item = TypeVar("Item", bound=Hashable)


class Limit(StrEnum):
    """A quota's limits, as the tenancy file and a refusal name them."""

    REQUESTS_PER_S = "requests_per_s"
    PROMPT_TOKENS_PER_MIN = "prompt_tokens_per_min"
    GENERATED_TOKENS_PER_MIN = "generated_tokens_per_min"
    CONCURRENT = "concurrent"


@dataclass(frozen=True)
class Quota:
    """What one principal may spend; None: no limit."""

    requests_per_s: float | None = None
    prompt_tokens_per_min: float | None = None
    generated_tokens_per_min: float | None = None
    concurrent: int | None = None
    """Requests at once."""

    def rate_per_s(self, limit: Limit) -> float | None:
        """`limit`'s refill rate per second (None: unlimited); CONCURRENT has none."""
        match limit:
            case Limit.REQUESTS_PER_S:
                return self.requests_per_s
            case Limit.PROMPT_TOKENS_PER_MIN | Limit.GENERATED_TOKENS_PER_MIN:
                per_min = getattr(self, limit.value)
                return None if per_min is None else per_min / 60.0
        return None

    def split(self, shares: int) -> "Quota":
        """One of `shares` equal parts: what each of that many services enforcing the quota
        side by side allows (concurrency rounds up: at least one request each)."""
        if shares == 1:
            return self

        def part(value: float | None) -> float | None:
            return None if value is None else value / shares

        concurrent = None if self.concurrent is None else math.ceil(self.concurrent / shares)
        return Quota(
            part(self.requests_per_s),
            part(self.prompt_tokens_per_min),
            part(self.generated_tokens_per_min),
            concurrent,
        )


@dataclass(frozen=True)
class Terms:
    """One principal's terms on a shared fleet."""

    weight: float = 1.0
    """Its share of a busy batch against others' (fair share), default equal."""
    quota: Quota = field(default_factory=Quota)


_QUOTA_FIELDS = {f.name for f in fields(Quota)}


@dataclass(frozen=True)
class Tenancy:
    """Every principal's terms (`default` for those not named)."""

    principals: Mapping[str, Terms] = field(default_factory=dict)
    default: Terms = field(default_factory=Terms)

    def terms(self, principal: str) -> Terms:
        return self.principals.get(principal, self.default)

    def weight(self, principal: str) -> float:
        return self.terms(principal).weight

    def split(self, shares: int) -> "Tenancy":
        """What each of `shares` services enforcing these terms side by side allows (weights
        are relative and stay)."""
        if shares < 1:
            raise ConfigurationError(f"quota shares {shares} must be at least 1")

        def part(terms: Terms) -> Terms:
            return replace(terms, quota=terms.quota.split(shares))

        return Tenancy({p: part(t) for p, t in self.principals.items()}, part(self.default))

    @classmethod
    def parse(cls, data: object, source: str) -> "Tenancy":
        """The tenancy file's JSON (`source` names it in errors); a bad value is refused
        naming the principal, the field and the value."""
        if not isinstance(data, dict) or set(data) - {"default", "principals"}:
            raise ConfigurationError(
                f"{source} is not a tenancy file: write a JSON object with 'default' and "
                "'principals' (principal -> {weight, requests_per_s, prompt_tokens_per_min, "
                "generated_tokens_per_min, concurrent})"
            )
        principals = data.get("principals", {})
        if not isinstance(principals, dict):
            raise ConfigurationError(
                f"{source}: 'principals' is not an object of principal -> terms"
            )
        return cls(
            {str(p): _terms(t, f"{source}: principal {p!r}") for p, t in principals.items()},
            _terms(data.get("default", {}), f"{source}: 'default'"),
        )


def _terms(data: object, where: str) -> Terms:
    if not isinstance(data, dict):
        raise ConfigurationError(f"{where} is {data!r}, not an object of terms")
    unknown = set(data) - _QUOTA_FIELDS - {"weight"}
    if unknown:
        raise ConfigurationError(
            f"{where} has unknown field(s) {sorted(unknown)}; the fields are 'weight' and "
            f"{sorted(_QUOTA_FIELDS)}"
        )
    for name, value in data.items():
        positive = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
        if (
            not positive
            or not math.isfinite(value)
            or (name == Limit.CONCURRENT and not isinstance(value, int))
        ):
            kind = "a whole number" if name == Limit.CONCURRENT else "a number"
            raise ConfigurationError(
                f"{where}: {name}={value!r} is not valid; write {kind} above 0 (leave a limit "
                "out for none)"
            )
    weight = data.get("weight", 1.0)
    return Terms(float(weight), Quota(**{k: v for k, v in data.items() if k != "weight"}))


class TenancyFile:
    """The terms a tenancy file holds, read again when it changes (at most every `RELOAD_S`);
    no file: everyone's default terms. A change that does not parse is logged and the last
    good terms stay."""

    def __init__(
        self, path: str | None, shares: int = 1, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.path = Path(path) if path else None
        self.shares = shares
        self._clock = clock
        self._lock = threading.Lock()
        self._checked = -math.inf
        self._stamp: tuple[int, int] | None = None
        self._tenancy = Tenancy().split(shares)
        if self.path is not None:
            self._tenancy = self._read()  # a bad file at start is the service's error

    def weight(self, principal: str) -> float:
        """`principal`'s weight in a busy batch, by the current terms."""
        return self.current().weight(principal)

    def current(self) -> Tenancy:
        if self.path is None:
            return self._tenancy
        now = self._clock()
        with self._lock:
            if now - self._checked >= RELOAD_S:
                self._checked = now
                try:
                    stat = os.stat(self.path)
                    if (stat.st_mtime_ns, stat.st_size) != self._stamp:
                        self._tenancy = self._read()
                        log.info("tenancy: read %s again", self.path)
                except (OSError, ConfigurationError) as e:
                    log.error("tenancy: kept the last good terms; %s", e)
            return self._tenancy

    def _read(self) -> Tenancy:
        assert self.path is not None
        try:
            stat = os.stat(self.path)
            data = json.loads(self.path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigurationError(
                f"MINT_TENANCY_FILE={self.path} is not a readable JSON file: {e}"
            ) from e
        tenancy = Tenancy.parse(data, f"MINT_TENANCY_FILE={self.path}").split(self.shares)
        self._stamp = (stat.st_mtime_ns, stat.st_size)
        return tenancy


# --- Limits ---------------------------------------------------------------------------------


@dataclass
class _Bucket:
    rate_per_s: float
    level: float
    at: float

    @property
    def burst(self) -> float:
        return max(self.rate_per_s * BURST_S, 1.0)

    def refill(self, now: float, rate_per_s: float) -> None:
        """Bring the level to `now` at the old rate, then take `rate_per_s` on (a quota
        changed); never above the burst."""
        self.level = min(self.burst, self.level + (now - self.at) * self.rate_per_s)
        self.at = now
        self.rate_per_s = rate_per_s
        self.level = min(self.level, self.burst)

    def wait_s(self, need: float) -> float:
        """Seconds until the level is at least `need`."""
        return max(0.0, (need - self.level) / self.rate_per_s)


_ROUNDING_S = 1e-6
"""A wait shorter than this is a float's rounding, not a limit (a clock of an earlier wait's
length would not even move)."""

_LET_IN_NEEDS = {
    Limit.REQUESTS_PER_S: 1.0,  # a whole request
    Limit.PROMPT_TOKENS_PER_MIN: 0.0,  # out of debt
    Limit.GENERATED_TOKENS_PER_MIN: 0.0,
}
"""The level a bucket must have for a request to be let in."""


@dataclass
class Admitted:
    """A request let in: what it paid, and what it pays when it ends (`finished`)."""

    limiter: "Limiter"
    principal: str
    _done: bool = False

    def finished(self, generated_tokens: int) -> None:
        """The request ended having generated `generated_tokens` (once; again is nothing)."""
        if not self._done:
            self._done = True
            self.limiter._finished(self.principal, generated_tokens)


class Limiter:
    """Every principal's buckets and requests at once, on one service; thread-safe.

    Token buckets, one per principal and rate: a bucket holds at most `BURST_S` seconds of its
    rate and refills continuously. A request is let in while each of its principal's buckets is
    not in debt (a requests bucket: has a whole request), and pays when the cost is known: one
    request and its prompt tokens at once, its generated tokens when it ends. A bucket may so go
    into debt by what the requests in flight generate beyond it; the next request waits the
    debt out. Over any window of T seconds a principal gets at most its rate times T, plus the
    burst, plus that overshoot. A refusal (`RateLimitedError`) says which limit and when the
    bucket will let the next request in: the HTTP answer's Retry-After.
    """

    def __init__(
        self, terms: Callable[[], Tenancy], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._terms = terms
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[tuple[str, Limit], _Bucket] = {}
        self._running: dict[str, int] = {}

    def admit(self, principal: str, prompt_tokens: int) -> Admitted:
        """Let a request of `principal` with `prompt_tokens` in, or refuse it with
        RateLimitedError naming the limit and when to ask again."""
        quota = self._terms().terms(principal).quota
        now = self._clock()
        with self._lock:
            buckets = self._refilled(principal, quota, now)
            waits = {limit: b.wait_s(_LET_IN_NEEDS[limit]) for limit, b in buckets.items()}
            limit, wait = max(waits.items(), key=lambda kv: kv[1], default=(None, 0.0))
            if limit is not None and wait > _ROUNDING_S:
                raise RateLimitedError(
                    f"principal {principal!r} is over its {limit.value} quota "
                    f"({_quota_of(quota, limit):g}); ask again in {wait:.2f} s",
                    limit.value,
                    wait,
                )
            running = self._running.get(principal, 0)
            if quota.concurrent is not None and running >= quota.concurrent:
                raise RateLimitedError(
                    f"principal {principal!r} has {running} requests running, its concurrent "
                    f"quota; ask again when one has ended",
                    Limit.CONCURRENT.value,
                    CONCURRENT_RETRY_S,
                )
            self._running[principal] = running + 1
            self._pay(buckets, Limit.REQUESTS_PER_S, 1)
            self._pay(buckets, Limit.PROMPT_TOKENS_PER_MIN, prompt_tokens)
        return Admitted(self, principal)

    def _finished(self, principal: str, generated_tokens: int) -> None:
        quota = self._terms().terms(principal).quota
        now = self._clock()
        with self._lock:
            buckets = self._refilled(principal, quota, now)
            self._pay(buckets, Limit.GENERATED_TOKENS_PER_MIN, generated_tokens)
            left = self._running.get(principal, 1) - 1
            if left:
                self._running[principal] = left
            else:
                self._running.pop(principal, None)

    def _refilled(self, principal: str, quota: Quota, now: float) -> dict[Limit, _Bucket]:
        """`principal`'s buckets, brought to `now` under `quota` (a limit it no longer has
        loses its bucket; a new one starts full)."""
        buckets = {}
        for limit in _LET_IN_NEEDS:
            rate = quota.rate_per_s(limit)
            key = (principal, limit)
            if rate is None:
                self._buckets.pop(key, None)
                continue
            bucket = self._buckets.get(key)
            if bucket is None:
                bucket = self._buckets[key] = _Bucket(rate, max(rate * BURST_S, 1.0), now)
            bucket.refill(now, rate)
            buckets[limit] = bucket
        return buckets

    @staticmethod
    def _pay(buckets: Mapping[Limit, _Bucket], limit: Limit, amount: float) -> None:
        if (bucket := buckets.get(limit)) is not None:
            bucket.level -= amount


def _quota_of(quota: Quota, limit: Limit) -> float:
    return float(getattr(quota, limit.value))


# --- Fair share -------------------------------------------------------------------------------


@dataclass
class _Tagged(Generic[Item]):
    item: Item
    principal: str
    start: float
    arrival: int


class FairQueue(Generic[Item]):
    """Waiting requests in fair-share order, by start-time fair queuing over tokens. Not
    thread-safe: its owner locks.

    Each request gets a start tag, the later of the queue's virtual time and where its
    principal's previous request ended, and ends at its start plus its cost (prompt plus
    `max_new_tokens`) divided by its principal's weight; requests join in start-tag order, ties
    in arrival order. A principal that sends ten times its share only lengthens its own line: a
    quiet principal's next request starts at the virtual time, ahead of the loud one's backlog.
    One principal alone is first come, first served.
    """

    def __init__(self, weight: Callable[[str], float] = lambda _: 1.0) -> None:
        self._weight = weight
        self._waiting: dict[Item, _Tagged[Item]] = {}
        self._finish: dict[str, float] = {}
        """Where each principal's last queued request ends, in virtual time."""
        self._virtual = 0.0
        """The start tag of the request that joined last."""
        self._arrivals = 0

    def push(self, item: Item, principal: str, cost: float) -> float:
        """Queue `item` of `principal`, costing `cost` tokens; its start tag (the lower, the
        sooner it joins)."""
        weight = self._weight(principal)
        start = max(self._virtual, self._finish.get(principal, 0.0))
        self._finish[principal] = start + cost / weight
        self._waiting[item] = _Tagged(item, principal, start, self._arrivals)
        self._arrivals += 1
        return start

    def ordered(self) -> list[Item]:
        """The waiting items, the next to join first."""
        tagged = sorted(self._waiting.values(), key=lambda t: (t.start, t.arrival))
        return [t.item for t in tagged]

    def take(self, item: Item) -> None:
        """`item` joins the batch: virtual time moves to its start."""
        tagged = self._waiting.pop(item, None)
        if tagged is None:  # dropped meanwhile
            return
        self._virtual = max(self._virtual, tagged.start)
        self._forget_idle()

    def drop(self, item: Item) -> None:
        """`item` leaves without joining (cancelled, failed): its place is given up."""
        self._waiting.pop(item, None)
        self._forget_idle()

    def _forget_idle(self) -> None:
        # A principal with nothing waiting whose last request ended in the past starts at the
        # virtual time anyway: forgetting it keeps the map as small as the waiting principals.
        waiting = {t.principal for t in self._waiting.values()}
        for principal in [
            p for p, f in self._finish.items() if p not in waiting and f <= self._virtual
        ]:
            del self._finish[principal]

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, item: object) -> bool:
        return item in self._waiting


RETURNING_S = 0.05
"""How long a principal whose request just ended keeps a row of a full batch for its next one:
a client in a closed loop sends it within milliseconds (the answer's round trip)."""


def batch_shares(
    wants: Mapping[str, int], weight: Callable[[str], float], rows: int
) -> dict[str, int]:
    """The most of a batch's `rows` each principal may hold, given how many it `wants` (running
    and waiting, or 1 for one returning): its weighted max-min fair share, rounded up. A
    principal that wants less than its share leaves the rest to the others (no row idles while
    someone waits for one); rounded up, shares of fewer rows than principals still let each in
    turn, in the fair queue's order.

    Why rows as well as the waiting order: a full batch frees a row only when a request ends,
    so a quiet principal put first in line still waits for a row the loud one holds; capped at
    its share, the loud one leaves the row a quiet request ended in to the next quiet one.
    """
    if sum(wants.values()) <= rows:
        return dict(wants)
    shares: dict[str, float] = {}
    left, unmet = float(rows), dict(wants)
    while unmet:
        level = left / sum(weight(p) for p in unmet)  # rows per unit of weight
        met = {p: n for p, n in unmet.items() if n <= level * weight(p)}
        if not met:
            shares |= {p: level * weight(p) for p in unmet}
            break
        shares |= met
        left -= sum(met.values())
        unmet = {p: n for p, n in unmet.items() if p not in met}
    return {p: math.ceil(share - 1e-9) for p, share in shares.items()}
