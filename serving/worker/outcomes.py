"""What happened to the requests a worker answered, per revision: what a canary is judged by.

Each generation answer gets a request id when it is routed (`started`), remembered with what
served it (the revision, or the base's model id) and who asked: the last `capacity` ids. When
the answer ends (`finished`) its latency and whether it failed on the worker's side are
recorded; the client may score it once, in [0, 1] (`score`, `POST /v1/feedback`).

`summary(since)` reads the recorded events of a window: per revision, requests, errors, error
rate, p50/p95 latency and feedback (`GET /admin/outcomes`);
`mint_core.planning.canary_judge.merge` adds up several workers'.
The same totals since the worker started are in `/metrics` (this is a Prometheus collector).
Each answer's usage (`mint_core.usage`) is also counted per principal and revision, by the
minute, for `usage(since)` (`GET /admin/usage`, `mint usage`), and per principal since start
in `/metrics`. Memory is bounded whatever the traffic: the last `capacity` request ids and
events, one set of totals per revision served, and at most `USAGE_ROWS` usage rows of the last
`USAGE_KEPT_S` seconds.
"""

import math
import threading
import time
import uuid
from collections import OrderedDict, defaultdict, deque
from collections.abc import Iterator
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import NamedTuple

from prometheus_client.core import CounterMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

from mint_core.access import ANONYMOUS
from mint_core.errors import AccessDeniedError, ConfigurationError, NotFoundError
from mint_core.planning.canary_judge import RevisionOutcomes
from mint_core.usage import Usage, UsageRow, merge

CAPACITY = 100_000
"""Request ids, and events, a worker remembers: at about 200 bytes each, some 40 MB at most."""
USAGE_KEPT_S = 25 * 3600
"""How far back `usage` reaches: a day, and an hour to spare for a report run late."""
USAGE_ROWS = 100_000
"""Usage rows (a principal's use of a revision in one minute) kept at most, about 200 bytes
each: past it the oldest minutes go first, and `usage` says from when it still knows."""


class _Kind(StrEnum):
    ANSWERED = "answered"
    """An answer ended; the value is its latency in seconds."""
    FAILED = "failed"
    """An answer failed on the worker's side; the value is its latency in seconds."""
    SCORED = "scored"
    """A client scored an answer; the value is the score."""


class _Event(NamedTuple):
    at: float
    """Unix time."""
    revision: str
    kind: _Kind
    value: float


@dataclass(frozen=True)
class _Asked:
    """A request id's answer, as remembered for its feedback."""

    revision: str
    principal: str
    score: float | None = None


@dataclass
class _Totals:
    """One revision's outcomes since the worker started (what `/metrics` exports)."""

    requests: int = 0
    errors: int = 0
    latency_s: float = 0.0
    feedback: int = 0
    score: float = 0.0


class Outcomes(Collector):
    """A worker's request ids and per-revision outcomes; safe to use from every thread."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._asked: OrderedDict[str, _Asked] = OrderedDict()
        self._events: deque[_Event] = deque(maxlen=capacity)
        self._totals: dict[str, _Totals] = {}
        self._usage: OrderedDict[int, defaultdict[tuple[str, str], Usage]] = OrderedDict()
        """Minute (Unix time // 60) -> (principal, revision) -> its usage in that minute."""
        self._usage_rows = 0
        self._forgotten_until = 0.0
        """Usage before this (Unix time) was let go (`USAGE_KEPT_S`, `USAGE_ROWS`)."""
        self._by_principal: dict[str, Usage] = {}
        """Each principal's usage since the worker started (for `/metrics`)."""

    def started(self, revision: str, principal: str, kind: str) -> str:
        """A new request id (`<kind>-<hex>`, e.g. OpenAI's `chatcmpl-…`) for an answer that
        `revision` serves to `principal`."""
        request_id = f"{kind}-{uuid.uuid4().hex}"
        with self._lock:
            self._asked[request_id] = _Asked(revision, principal)
            if len(self._asked) > self.capacity:
                self._asked.popitem(last=False)
        return request_id

    def finished(
        self,
        revision: str,
        latency_s: float,
        failed: bool,
        usage: Usage | None = None,
        principal: str = ANONYMOUS,
    ) -> None:
        """An answer `revision` served to `principal` ended, `latency_s` seconds after it was
        routed, having used `usage`'s tokens and time in queue."""
        kind = _Kind.FAILED if failed else _Kind.ANSWERED
        used = replace(usage or Usage(), requests=1, errors=int(failed))
        with self._lock:
            self._events.append(_Event(time.time(), revision, kind, latency_s))
            totals = self._totals.setdefault(revision, _Totals())
            totals.requests += 1
            totals.errors += failed
            totals.latency_s += latency_s
            self._used(principal, revision, used)

    def refused(self, revision: str, principal: str) -> None:
        """A request of `principal`'s for `revision` was refused over its quota."""
        with self._lock:
            self._used(principal, revision, Usage(rate_limited=1))

    def _used(self, principal: str, revision: str, usage: Usage) -> None:
        """Count `usage` in this minute's rows and `principal`'s totals (the lock held)."""
        minute = int(time.time() // 60)
        rows = self._usage.get(minute)
        if rows is None:
            rows = self._usage[minute] = defaultdict(Usage)
            while self._usage and next(iter(self._usage)) < minute - USAGE_KEPT_S // 60:
                self._forget_oldest_minute()
        key = (principal, revision)
        if key not in rows:
            self._usage_rows += 1
            while self._usage_rows > USAGE_ROWS and len(self._usage) > 1:
                self._forget_oldest_minute()
        rows[key] += usage
        self._by_principal[principal] = self._by_principal.get(principal, Usage()) + usage

    def _forget_oldest_minute(self) -> None:
        minute, rows = self._usage.popitem(last=False)
        self._usage_rows -= len(rows)
        self._forgotten_until = (minute + 1) * 60.0

    def usage(self, since: float = 0.0) -> tuple[list[UsageRow], float]:
        """Each principal's usage of each revision from the minute of `since` (Unix time) on,
        and the time from which this worker still knows it: later than `since` only where it
        let older minutes go (`USAGE_KEPT_S`, `USAGE_ROWS`), not because it started later."""
        first = int(since // 60)
        with self._lock:
            kept_since = max(since, self._forgotten_until)
            minutes = [rows.copy() for minute, rows in self._usage.items() if minute >= first]
        used = (UsageRow(p, r, u) for rows in minutes for (p, r), u in rows.items())
        return merge(used), kept_since

    def score(self, request_id: str, score: float, principal: str) -> str:
        """Record `principal`'s score of the answer `request_id`; the revision that served it.
        NotFoundError for an id this worker does not remember, AccessDeniedError for another
        principal's answer, ConfigurationError for a second score or one outside [0, 1]."""
        if not 0 <= score <= 1:  # NaN fails too
            raise ConfigurationError(f"score {score} is not valid; send a number from 0 to 1")
        with self._lock:
            asked = self._asked.get(request_id)
            if asked is None:
                raise NotFoundError(
                    f"request id {request_id!r} is not one this worker answered, or it is older "
                    f"than the last {self.capacity} it remembers; send the X-Mint-Request-Id of "
                    "an answer"
                )
            if asked.principal != principal:
                raise AccessDeniedError(
                    f"principal {principal!r} did not make request {request_id!r}; only the "
                    "principal that asked may score an answer"
                )
            if asked.score is not None:
                raise ConfigurationError(
                    f"request {request_id!r} was scored already ({asked.score}); an answer "
                    "takes one score"
                )
            self._asked[request_id] = replace(asked, score=score)
            self._events.append(_Event(time.time(), asked.revision, _Kind.SCORED, score))
            totals = self._totals.setdefault(asked.revision, _Totals())
            totals.feedback += 1
            totals.score += score
        return asked.revision

    def summary(self, since: float = 0.0) -> dict[str, RevisionOutcomes]:
        """Per revision, what happened at or after `since` (Unix time) among the events still
        remembered."""
        latencies: dict[str, list[float]] = {}
        errors: dict[str, int] = {}
        scores: dict[str, list[float]] = {}
        with self._lock:
            events = list(self._events)
        for event in events:
            if event.at < since:
                continue
            if event.kind is _Kind.SCORED:
                scores.setdefault(event.revision, []).append(event.value)
                continue
            latencies.setdefault(event.revision, []).append(event.value)
            errors[event.revision] = errors.get(event.revision, 0) + (event.kind is _Kind.FAILED)
        summary = {}
        for revision in sorted(latencies.keys() | scores.keys()):
            answered = sorted(latencies.get(revision, []))
            scored = scores.get(revision, [])
            summary[revision] = RevisionOutcomes(
                revision=revision,
                requests=len(answered),
                errors=errors.get(revision, 0),
                latency_p50_s=_quantile(answered, 0.5),
                latency_p95_s=_quantile(answered, 0.95),
                feedback=len(scored),
                mean_score=sum(scored) / len(scored) if scored else None,
            )
        return summary

    def collect(self) -> Iterator[Metric]:
        """The totals since the worker started, labelled by revision, for `/metrics`."""
        with self._lock:
            totals = {revision: replace(t) for revision, t in self._totals.items()}
            by_principal = dict(self._by_principal)
        requests = CounterMetricFamily(
            "mint_revision_requests", "Answers ended, by revision", labels=["revision"]
        )
        errors = CounterMetricFamily(
            "mint_revision_errors", "Answers failed after routing, by revision", labels=["revision"]
        )
        latency = SummaryMetricFamily(
            "mint_revision_latency_seconds", "Routing to answer's end", labels=["revision"]
        )
        feedback = SummaryMetricFamily(
            "mint_revision_feedback_score", "Clients' scores of answers", labels=["revision"]
        )
        for revision, t in sorted(totals.items()):
            requests.add_metric([revision], t.requests)
            errors.add_metric([revision], t.errors)
            latency.add_metric([revision], t.requests, t.latency_s)
            feedback.add_metric([revision], t.feedback, t.score)
        yield from (requests, errors, latency, feedback)
        yield from _principal_metrics(by_principal)


def _principal_metrics(by_principal: dict[str, Usage]) -> Iterator[Metric]:
    """Usage since start labelled by principal only: the keys file bounds those series. By
    revision too, a fleet of 10^6 adapters would make as many series per principal; usage per
    revision is `GET /admin/usage`'s (`mint usage`)."""
    counted = {
        "requests": "Answers ended",
        "errors": "Answers failed on the worker's side",
        "rate_limited": "Requests refused over a quota (429)",
        "prompt_tokens": "Prompt tokens of answers ended",
        "generated_tokens": "Tokens generated",
    }
    families = {
        name: CounterMetricFamily(
            f"mint_principal_{name}", f"{help}, by principal", labels=["principal"]
        )
        for name, help in counted.items()
    }
    queue = SummaryMetricFamily(
        "mint_principal_queue_seconds",
        "Submission to first token, by principal",
        labels=["principal"],
    )
    for principal, used in sorted(by_principal.items()):
        for name, family in families.items():
            family.add_metric([principal], getattr(used, name))
        queue.add_metric([principal], used.requests, used.queue_s)
    yield from families.values()
    yield queue


def _quantile(ordered: list[float], q: float) -> float | None:
    """The nearest-rank `q` quantile of the sorted `ordered`; None if it is empty."""
    if not ordered:
        return None
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]
