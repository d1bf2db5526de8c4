"""A worker's readiness table and its prewarm threads, without an engine, a registry or any
process: the bounds on what the table keeps, the engine generation check that decides whether
a warmed revision becomes ready, and a prewarm thread that outlives its own error handling."""

import threading
import time
from collections.abc import Callable, Sequence

import pytest

from mint_core.errors import EngineUnavailableError
from mint_core.planning.admission import Priority
from mint_core.planning.residency import Residency
from mint_core.revisions import RevisionId
from mint_core.states import Readiness
from serving.engine.generation import Generating
from serving.engine.sampling import SamplingParams
from serving.metrics import WorkerMetrics
from serving.worker import readiness
from serving.worker.readiness import ReadinessTable
from serving.worker.worker import Worker
from tests.helpers import make_policy

R1, R2 = RevisionId("support-bot", 1), RevisionId("support-bot", 2)


def warmed(table: ReadinessTable, revision: RevisionId) -> None:
    """`revision` through admission, fetching and warming, as a prewarm thread moves it (the
    table takes 4 at a time: `next_admitted` would wait for a free one)."""
    table.admit(revision, Priority.NORMAL)
    assert table.next_admitted(threading.Event()) == revision
    table.move(revision, Readiness.FETCHING)
    table.warming(revision, make_policy(adapter=revision.adapter))


def test_a_revision_warmed_on_a_lost_engine_never_becomes_ready() -> None:
    table = ReadinessTable(admission_k=4)
    warmed(table, R1)
    assert table.engine_lost(0) == []
    assert table.engine_lost_since(0) and not table.engine_lost_since(1)
    with pytest.raises(EngineUnavailableError, match="generation 0"):
        table.make_ready(R1, 0, lambda: True)
    assert table.entry(R1).state is Readiness.WARMING


def test_a_revision_made_ready_before_its_engine_is_reported_lost_is_handed_back() -> None:
    table = ReadinessTable(admission_k=4)
    warmed(table, R1)
    assert table.make_ready(R1, 0, lambda: True)
    assert table.ready() == [R1]
    assert table.engine_lost(0) == [R1], "what engine_lost returns is what the worker drops"
    warmed_on_next = R2
    warmed(table, warmed_on_next)
    assert table.make_ready(warmed_on_next, 1, lambda: True), "the next engine serves"


def test_a_revision_evicted_while_it_warmed_goes_back_to_not_admitted() -> None:
    table = ReadinessTable(admission_k=4)
    warmed(table, R1)
    assert not table.make_ready(R1, 0, lambda: False)
    entry = table.entry(R1)
    assert (entry.state, entry.reason) == (Readiness.NOT_ADMITTED, "evicted from host cache")


def test_the_event_log_and_stopped_entries_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(readiness, "INACTIVE_ENTRIES", 3)
    table = ReadinessTable(admission_k=4)
    table._events = type(table._events)(maxlen=5)  # a small ring, as EVENT_LOG_LENGTH makes one
    revisions = [RevisionId("support-bot", n) for n in range(1, 6)]
    for revision in revisions:
        table.admit(revision, Priority.NORMAL)
        assert table.next_admitted(threading.Event()) == revision
        table.move(revision, Readiness.FAILED, reason=f"bad {revision.number}")
        table.finish(revision)
    assert [e.state for e in table.events()] == [Readiness.FAILED] + [
        Readiness.QUEUED,
        Readiness.FAILED,
    ] * 2
    assert [e.revision for e in table.entries("support-bot")] == revisions[-3:]
    assert table.entry(revisions[0]).state is Readiness.NOT_ADMITTED, "forgotten: never admitted"
    assert table.entry(revisions[-1]).reason == "bad 5"


def test_an_active_entry_is_never_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(readiness, "INACTIVE_ENTRIES", 1)
    table = ReadinessTable(admission_k=4)
    warmed(table, R1)
    table.make_ready(R1, 0, lambda: True)
    for number in (2, 3, 4):
        revision = RevisionId("support-bot", number)
        table.admit(revision, Priority.NORMAL)
        table.move(revision, Readiness.FAILED, reason="bad")
    assert [e.revision.number for e in table.entries("support-bot")] == [1, 4]
    assert table.ready() == [R1]


class _NoEngine:
    """A backend whose engine is never asked for anything: these tests stop before it."""

    kind = "none"
    generation = 0

    def __init__(self) -> None:
        self.residency: Residency[object] = Residency(1 << 20, 1)
        self.metrics = WorkerMetrics(self.residency)
        self.lost: list[Callable[[int], None]] = []

    def on_lost(self, callback: Callable[[int], None]) -> None:
        self.lost.append(callback)

    def problem(self) -> str | None:
        return None

    def unload(self, key: str) -> None: ...

    @property
    def request_path_loads(self) -> int:
        return 0

    def submit(
        self, prompt_ids: Sequence[int], key: str, params: SamplingParams, *args: object
    ) -> Generating:
        raise AssertionError("no generation in these tests")

    def close(self) -> None: ...


class _QuietCatalog:
    """A catalog whose registry wants nothing."""

    def sync(self) -> None: ...

    def held_moves(self) -> list[object]:
        return []

    def desired(self) -> list[RevisionId]:
        return []

    def close(self) -> None: ...


def test_a_worker_hears_of_a_lost_engine_before_any_of_its_threads_runs() -> None:
    backend = _NoEngine()
    worker = Worker(backend, _QuietCatalog(), store=None, sync_interval_s=3600)  # type: ignore[arg-type]
    try:
        assert len(backend.lost) == 1 and not worker._threads
    finally:
        worker.close()


def test_a_prewarm_thread_outlives_an_error_in_its_own_error_handling(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With one prewarm thread, a failure while recording the first revision's failure must
    not stop the second revision's prewarm."""
    worker = Worker(_NoEngine(), _QuietCatalog(), None, admission_k=1, sync_interval_s=3600)  # type: ignore[arg-type]
    handled: list[RevisionId] = []

    def prewarm_or_fail(revision: RevisionId) -> None:
        handled.append(revision)
        if len(handled) == 1:
            raise RuntimeError("recording the failure failed")

    worker._prewarm.prewarm_or_fail = prewarm_or_fail  # type: ignore[method-assign]
    worker.start()
    try:
        worker.admit(R1)
        worker.admit(R2)
        deadline = time.monotonic() + 30
        while len(handled) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert handled == [R1, R2]
        assert "ended in an error of its own handling" in caplog.text
    finally:
        worker.close()


def test_a_late_prewarm_suggests_ever_longer_waits() -> None:
    """A revision still fetching past the prewarm estimate: each "not ready" answer suggests
    half the time it has taken so far, so a client honouring them spreads a fixed number of
    retries over a slow fetch rather than spending them at the floor."""
    table = ReadinessTable(admission_k=4)
    each = readiness.FIRST_PREWARM_S

    def suggested(elapsed: float) -> float:
        entry = readiness.ReadinessEntry(R1, Readiness.FETCHING, time.time() - elapsed)
        wait = table.wait_estimate(entry)
        assert wait is not None
        return wait

    assert suggested(0.1) == pytest.approx(each - 0.1, abs=0.01)  # on time: what is left
    assert suggested(4.0) == pytest.approx(2.0, abs=0.01)
    elapsed, retries = each, 0
    while elapsed < 60:  # a client honouring each answer, from the moment it is late
        elapsed += suggested(elapsed)
        retries += 1
    assert retries <= 12  # the floor's 0.05 s would have taken over a thousand
