"""What happened to the requests a worker answered, per revision: what a canary is judged by.

Each generation answer gets a request id when it is routed (`started`), remembered with what
served it (the revision, or the base's model id) and who asked: the last `capacity` ids. When
the answer ends (`finished`) its latency and whether it failed on the worker's side are
recorded; the client may score it once, in [0, 1] (`score`, `POST /v1/feedback`).

`summary(since)` reads the recorded events of a window: per revision, requests, errors, error
rate, p50/p95 latency and feedback (`GET /admin/outcomes`);
`mint_core.planning.canary_judge.merge` adds up several workers'.
The same totals since the worker started are in `/metrics` (this is a Prometheus collector).
Memory is bounded whatever the traffic: the last `capacity` request ids and events, and one
set of totals per revision served.
"""

import math
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import NamedTuple

from prometheus_client.core import CounterMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

from mint_core.errors import AccessDeniedError, ConfigurationError, NotFoundError
from mint_core.planning.canary_judge import RevisionOutcomes

CAPACITY = 100_000
"""Request ids, and events, a worker remembers: at about 200 bytes each, some 40 MB at most."""


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

    def started(self, revision: str, principal: str, kind: str) -> str:
        """A new request id (`<kind>-<hex>`, e.g. OpenAI's `chatcmpl-…`) for an answer that
        `revision` serves to `principal`."""
        request_id = f"{kind}-{uuid.uuid4().hex}"
        with self._lock:
            self._asked[request_id] = _Asked(revision, principal)
            if len(self._asked) > self.capacity:
                self._asked.popitem(last=False)
        return request_id

    def finished(self, revision: str, latency_s: float, failed: bool) -> None:
        """An answer `revision` served ended, `latency_s` seconds after it was routed."""
        kind = _Kind.FAILED if failed else _Kind.ANSWERED
        with self._lock:
            self._events.append(_Event(time.time(), revision, kind, latency_s))
            totals = self._totals.setdefault(revision, _Totals())
            totals.requests += 1
            totals.errors += failed
            totals.latency_s += latency_s

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


def _quantile(ordered: list[float], q: float) -> float | None:
    """The nearest-rank `q` quantile of the sorted `ordered`; None if it is empty."""
    if not ordered:
        return None
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]
