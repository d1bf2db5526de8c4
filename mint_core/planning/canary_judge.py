"""Judging a canary: the candidate's live figures against production's over the same window,
by the adapter's margins (mint_core/gates.py). Workers report `RevisionOutcomes` per revision
(`GET /admin/outcomes`); `merge` adds several workers' up; `judge` decides."""

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Self

from mint_core.gates import Gates


@dataclass(frozen=True)
class RevisionOutcomes:
    """One revision's requests over a window, as `GET /admin/outcomes` reports them."""

    revision: str
    """The exact revision (`name:rN`), or the base's model id."""
    requests: int
    """Answers that ended (failed ones included)."""
    errors: int
    """Answers that failed on the worker's side after routing (a 5xx, or a stream's error
    event); a request the worker refused as malformed is the caller's, not counted."""
    latency_p50_s: float | None
    """From routing to the answer's end; None without requests."""
    latency_p95_s: float | None
    feedback: int
    """Scores received."""
    mean_score: float | None
    """None without feedback."""

    @property
    def error_rate(self) -> float | None:
        return self.errors / self.requests if self.requests else None

    def to_json(self) -> dict[str, object]:
        return asdict(self) | {"error_rate": self.error_rate}

    @classmethod
    def empty(cls, revision: str) -> Self:
        """A revision that answered nothing in the window."""
        return cls(revision, 0, 0, None, None, 0, None)

    def describe(self) -> str:
        rate = f"{self.error_rate:.1%}" if self.error_rate is not None else "-"
        p95 = f"{self.latency_p95_s * 1000:.0f} ms" if self.latency_p95_s is not None else "-"
        score = f"{self.mean_score:.3f} ({self.feedback} scored)" if self.feedback else "none"
        return (
            f"{self.revision}: {self.requests} requests, error rate {rate}, p95 {p95}, "
            f"mean feedback {score}"
        )

    @classmethod
    def from_json(cls, values: Mapping[str, object]) -> Self:
        return cls(**{k: v for k, v in values.items() if k != "error_rate"})  # type: ignore[arg-type]


def merge(summaries: Iterable[Mapping[str, RevisionOutcomes]]) -> dict[str, RevisionOutcomes]:
    """Several workers' summaries as one: counts add up, mean scores are weighted by their
    counts. Latency quantiles cannot be added up from quantiles: each is the slowest worker's,
    an upper bound on the fleet's."""
    merged: dict[str, RevisionOutcomes] = {}
    for summary in summaries:
        for name, theirs in summary.items():
            ours = merged.get(name)
            merged[name] = theirs if ours is None else _added(ours, theirs)
    return merged


def _added(a: RevisionOutcomes, b: RevisionOutcomes) -> RevisionOutcomes:
    feedback = a.feedback + b.feedback
    scores = [(o.mean_score, o.feedback) for o in (a, b) if o.mean_score is not None]
    return replace(
        a,
        requests=a.requests + b.requests,
        errors=a.errors + b.errors,
        latency_p50_s=_slowest(a.latency_p50_s, b.latency_p50_s),
        latency_p95_s=_slowest(a.latency_p95_s, b.latency_p95_s),
        feedback=feedback,
        mean_score=sum(m * n for m, n in scores) / feedback if feedback else None,
    )


def _slowest(a: float | None, b: float | None) -> float | None:
    return max((v for v in (a, b) if v is not None), default=None)


@dataclass(frozen=True)
class CanaryVerdict:
    promote: bool
    reason: str
    """Both revisions' figures and each margin that decided it."""


def judge(
    candidate: RevisionOutcomes,
    production: RevisionOutcomes,
    gates: Gates,
    min_requests: int,
) -> CanaryVerdict:
    """Promote unless the candidate is worse than production beyond a margin, or served fewer
    than `min_requests` requests (too little to judge: rolled back, as nothing shows it is
    good). Latency and feedback are compared only where both revisions have some."""
    problems = []
    if candidate.requests < min_requests:
        problems.append(f"only {candidate.requests} requests reached it (at least {min_requests})")
    increase = (candidate.error_rate or 0.0) - (production.error_rate or 0.0)
    if increase > gates.canary_max_error_increase:
        problems.append(
            f"error rate {increase:+.1%} over production's "
            f"(max {gates.canary_max_error_increase:+.1%})"
        )
    mine, theirs = candidate.latency_p95_s, production.latency_p95_s
    if mine is not None and theirs and mine / theirs > gates.canary_max_p95_ratio:
        problems.append(
            f"p95 latency {mine / theirs:.2f}x production's (max {gates.canary_max_p95_ratio:.2f}x)"
        )
    mine, theirs = candidate.mean_score, production.mean_score
    if mine is not None and theirs is not None and theirs - mine > gates.canary_max_score_drop:
        problems.append(
            f"mean feedback {theirs - mine:.3f} below production's "
            f"(max drop {gates.canary_max_score_drop:.3f})"
        )
    figures = f"canary {candidate.describe()}; production {production.describe()}"
    if problems:
        return CanaryVerdict(False, f"rolled back: {'; '.join(problems)} ({figures})")
    return CanaryVerdict(True, f"promoted: within every margin ({figures})")
