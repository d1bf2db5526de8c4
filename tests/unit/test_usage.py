"""Usage per principal and revision: counted by the minute on a worker (bounded), added up over
workers, grouped and written as `mint usage` prints it."""

import csv
import io
import json

import pytest
from prometheus_client import generate_latest
from prometheus_client.registry import CollectorRegistry

from mint_core.usage import Usage, UsageBy, UsageFormat, UsageRow, grouped, merge, report
from serving.worker import outcomes as outcomes_module
from serving.worker.outcomes import Outcomes

T0 = 1_800_000_000.0
"""A minute's start (divisible by 60)."""


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [T0]
    monkeypatch.setattr(outcomes_module.time, "time", lambda: now[0])
    return now


def test_a_workers_usage_is_each_principals_per_revision_from_the_minute_asked(
    clock: list[float],
) -> None:
    outcomes = Outcomes()
    outcomes.finished("bot:r1", 0.2, False, Usage(prompt_tokens=5, generated_tokens=7), "alice")
    outcomes.finished("bot:r1", 0.3, True, Usage(prompt_tokens=3, queue_s=0.5), "alice")
    outcomes.refused("bot:r1", "bob")
    clock[0] = T0 + 125  # two minutes on
    outcomes.finished("bot:r2", 0.1, False, Usage(prompt_tokens=2, generated_tokens=4), "alice")

    rows, kept_since = outcomes.usage()
    assert kept_since == 0.0  # it has let nothing go (it started at T0: nothing before)
    assert rows == [
        UsageRow(
            "alice", "bot:r1", Usage(2, 1, 0, prompt_tokens=8, generated_tokens=7, queue_s=0.5)
        ),
        UsageRow("alice", "bot:r2", Usage(1, 0, 0, prompt_tokens=2, generated_tokens=4)),
        UsageRow("bob", "bot:r1", Usage(rate_limited=1)),
    ]
    # From a time within the last minute: that whole minute's rows, none before.
    later, since = outcomes.usage(T0 + 130)
    assert [(r.principal, r.revision) for r in later] == [("alice", "bot:r2")]
    assert since == T0 + 130


def test_usage_is_bounded_dropping_the_oldest_minutes_and_says_from_when_it_knows(
    clock: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(outcomes_module, "USAGE_ROWS", 4)
    outcomes = Outcomes()
    for minute in range(3):
        clock[0] = T0 + 60 * minute
        for principal in ("a", "b"):
            outcomes.finished("bot:r1", 0.1, False, Usage(prompt_tokens=1), principal)
    rows, kept_since = outcomes.usage()
    assert kept_since == T0 + 60  # the first minute went to keep 4 rows
    assert {r.principal: r.usage.requests for r in rows} == {"a": 2, "b": 2}
    # A minute older than a day and an hour goes whatever the row count.
    clock[0] = T0 + outcomes_module.USAGE_KEPT_S + 180
    outcomes.finished("bot:r1", 0.1, False, None, "c")
    rows, kept_since = outcomes.usage()
    assert [r.principal for r in rows] == ["c"] and kept_since == T0 + 180


def test_metrics_label_usage_by_principal_only(clock: list[float]) -> None:
    outcomes = Outcomes()
    for revision in ("bot:r1", "bot:r2", "other:r9"):
        outcomes.finished(revision, 0.1, False, Usage(generated_tokens=10, queue_s=0.25), "team-a")
    outcomes.refused("bot:r1", "team-b")
    registry = CollectorRegistry()
    registry.register(outcomes)
    text = generate_latest(registry).decode()
    assert 'mint_principal_generated_tokens_total{principal="team-a"} 30.0' in text
    assert 'mint_principal_rate_limited_total{principal="team-b"} 1.0' in text
    assert 'mint_principal_queue_seconds_sum{principal="team-a"} 0.75' in text
    principal_lines = [line for line in text.splitlines() if line.startswith("mint_principal")]
    assert principal_lines and not any("revision=" in line for line in principal_lines)


ROWS = [
    UsageRow("alice", "bot:r1", Usage(requests=2, prompt_tokens=10, generated_tokens=20)),
    UsageRow("bob", "bot:r1", Usage(requests=1, rate_limited=3, generated_tokens=5)),
    UsageRow("alice", "tiny-base", Usage(requests=1, errors=1, queue_s=0.5)),
]


def test_workers_rows_merge_and_group_by_principal_or_adapter() -> None:
    other_worker = [UsageRow("alice", "bot:r1", Usage(requests=1, prompt_tokens=4))]
    merged = merge([*ROWS, *other_worker])
    assert merged[0] == UsageRow("alice", "bot:r1", Usage(3, prompt_tokens=14, generated_tokens=20))
    assert len(merged) == 3
    assert grouped(merged, UsageBy.PRINCIPAL)["alice"].requests == 4
    assert grouped(merged, UsageBy.ADAPTER)["bot:r1"] == Usage(
        4, 0, 3, prompt_tokens=14, generated_tokens=25
    )
    assert [UsageRow.from_json(r.to_json()) for r in merged] == merged


def test_a_report_reads_as_a_table_csv_or_json() -> None:
    table = report(ROWS, UsageBy.ADAPTER, UsageFormat.TABLE, T0).splitlines()
    assert table[0].split() == ["adapter", *[f for f in Usage().to_json()]]
    assert table[1].split()[:2] == ["bot:r1", "3"] and table[2].startswith("tiny-base")
    assert len({len(line) for line in table}) == 1  # columns line up
    rows = list(csv.reader(io.StringIO(report(ROWS, UsageBy.PRINCIPAL, UsageFormat.CSV, T0))))
    assert rows[0][0] == "principal" and [r[0] for r in rows[1:]] == ["alice", "bob"]
    assert rows[1][1:4] == ["3", "1", "0"] and rows[1][-1] == "0.50"
    payload = json.loads(report(ROWS, UsageBy.PRINCIPAL, UsageFormat.JSON, T0))
    assert payload["since"] == T0 and payload["rows"]["bob"]["rate_limited"] == 3
    assert report([], UsageBy.PRINCIPAL, UsageFormat.TABLE, T0) == "no requests in this window"
