"""What each principal used of each revision: the figures a platform that budgets or bills by
team reads, added up over a fleet's workers and grouped for `mint usage`."""

import csv
import io
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from enum import StrEnum


@dataclass(frozen=True)
class Usage:
    """Requests' totals: of one principal on one revision, or any sum of them."""

    requests: int = 0
    """Answers ended (a refusal over a quota is not one: see `rate_limited`)."""
    errors: int = 0
    """Answers that failed on the worker's side."""
    rate_limited: int = 0
    """Requests refused over a quota (429)."""
    prompt_tokens: int = 0
    generated_tokens: int = 0
    queue_s: float = 0.0
    """Seconds from submission to the first token, summed (prefill included: neither engine
    tells a request the two apart)."""

    def __add__(self, other: "Usage") -> "Usage":
        return Usage(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(Usage)))

    def to_json(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, float]) -> "Usage":
        return cls(**{f.name: data[f.name] for f in fields(cls)})  # type: ignore[arg-type]


@dataclass(frozen=True)
class UsageRow:
    """One principal's usage of one revision (the revision, or the base's model id)."""

    principal: str
    revision: str
    usage: Usage

    def to_json(self) -> dict[str, object]:
        return {"principal": self.principal, "revision": self.revision, **self.usage.to_json()}

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> "UsageRow":
        return cls(str(data["principal"]), str(data["revision"]), Usage.from_json(data))  # type: ignore[arg-type]


class UsageBy(StrEnum):
    """What `mint usage` groups by."""

    PRINCIPAL = "principal"
    ADAPTER = "adapter"
    """The revision served (`name:rN`, or the base's model id)."""


class UsageFormat(StrEnum):
    TABLE = "table"
    CSV = "csv"
    JSON = "json"


def merge(rows: Iterable[UsageRow]) -> list[UsageRow]:
    """Rows of several workers as one row per principal and revision, sorted."""
    totals: dict[tuple[str, str], Usage] = {}
    for row in rows:
        key = (row.principal, row.revision)
        totals[key] = totals.get(key, Usage()) + row.usage
    return [UsageRow(p, r, u) for (p, r), u in sorted(totals.items())]


def grouped(rows: Iterable[UsageRow], by: UsageBy) -> dict[str, Usage]:
    """Totals per principal or per revision, sorted by name."""
    totals: dict[str, Usage] = {}
    for row in rows:
        name = row.principal if by is UsageBy.PRINCIPAL else row.revision
        totals[name] = totals.get(name, Usage()) + row.usage
    return dict(sorted(totals.items()))


_COLUMNS = [f.name for f in fields(Usage)]


def report(rows: Sequence[UsageRow], by: UsageBy, form: UsageFormat, since: float) -> str:
    """`rows` grouped `by` principal or adapter, as a table for a terminal, CSV, or JSON."""
    totals = grouped(rows, by)
    if form is UsageFormat.JSON:
        payload = {
            "since": since,
            "by": by.value,
            "rows": {n: u.to_json() for n, u in totals.items()},
        }
        return json.dumps(payload, indent=2)
    header = [by.value, *_COLUMNS]
    lines = [[name, *(_cell(getattr(u, c)) for c in _COLUMNS)] for name, u in totals.items()]
    if form is UsageFormat.CSV:
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerows([header, *lines])
        return out.getvalue()
    if not lines:
        return "no requests in this window"
    table = [header, *lines]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    # Names left, figures right: a column of numbers reads by its last digits.
    return "\n".join(
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in table
    )


def _cell(value: float) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def adapter_table(rows: Iterable[UsageRow]) -> list[dict[str, object]]:
    """Per revision, the figures a release manager reads (the Prefect UI's usage table): who
    used it (busiest first), its use, and its mean time in queue. Short headers: the table's
    every column fits a laptop's screen."""
    rows = list(rows)
    users: dict[str, list[UsageRow]] = {}
    for row in rows:
        users.setdefault(row.revision, []).append(row)
    table = []
    for revision, used in grouped(rows, UsageBy.ADAPTER).items():
        principals = sorted(users[revision], key=lambda r: -r.usage.requests)
        table.append(
            {
                "revision": revision,
                "used by": ", ".join(r.principal for r in principals),
                "requests": used.requests,
                "errors": used.errors,
                "429s": used.rate_limited,
                "tokens in": used.prompt_tokens,
                "tokens out": used.generated_tokens,
                "queue ms": round(1000 * used.queue_s / max(used.requests, 1), 1),
            }
        )
    return table
