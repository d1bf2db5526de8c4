"""The catalog's answers kept in memory (`mint_core.catalog.hot`) and its per-thread readers: a
sync's change is never answered stale once the sync returns (an alias moved, a new revision, a
canary set), not even by an answer computed from the index while the sync was writing; many
threads read at once; a replaced index file is read by every thread from then on. Against a
registry held in memory: what the catalog asks of MLflow is the same two calls."""

import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mint_core.catalog.catalog import Catalog
from mint_core.catalog.hot import HotMap
from mint_core.catalog.index import CatalogIndex
from mint_core.registry import AdapterAliases
from mint_core.revisions import CANARY, CANDIDATE, PRODUCTION, RevisionId, RevisionRef
from tests.helpers import BASE_DIGEST as BASE
from tests.helpers import MemoryRegistry


@pytest.fixture
def registry() -> MemoryRegistry:
    registry = MemoryRegistry()
    for number in (1, 2, 3):
        registry.add("bot", number)
    registry.set("bot", production=1, candidate=2)
    return registry


@pytest.fixture
def catalog(registry: MemoryRegistry, tmp_path: Path) -> Iterator[Catalog]:
    catalog = Catalog(registry, base_digest=BASE, folder=tmp_path)
    catalog.sync()
    yield catalog
    catalog.close()


def test_the_hot_map_forgets_a_changed_adapter_and_an_answer_computed_before_the_change() -> None:
    hot: HotMap[str] = HotMap(capacity=100)
    hot.put(hot.stamp("a"), "a-key", "old")
    hot.put(hot.stamp("b"), "b-key", "kept")
    assert hot.get("a", "a-key") == "old"

    computing = hot.stamp("a")  # an answer about "a" read from the index before the change...
    hot.invalidate(["a"])  # ...the change committed, then invalidated...
    hot.put(computing, "a-key", "old")  # ...and the old answer kept after it
    assert hot.get("a", "a-key") is None
    assert hot.get("b", "b-key") == "kept"

    hot.put(hot.stamp("a"), "a-key", "new")
    assert hot.get("a", "a-key") == "new"
    computing = hot.stamp("b")
    hot.invalidate()  # everything
    hot.put(computing, "b-key", "kept")
    assert hot.get("a", "a-key") is None and hot.get("b", "b-key") is None


def test_the_hot_map_is_bounded_one_in_one_out() -> None:
    hot: HotMap[int] = HotMap(capacity=10)
    for n in range(25):
        hot.put(hot.stamp("a"), n, n)
        hot.put(hot.stamp("a"), n, n)  # kept again: still one entry
        assert len(hot) == min(n + 1, 10)
    assert [hot.get("a", n) for n in range(14, 17)] == [None, 15, 16]


def test_a_sync_is_never_answered_stale_once_it_returns(
    registry: MemoryRegistry, catalog: Catalog
) -> None:
    asked = {ref: catalog.resolve(ref).id for ref in (RevisionRef("bot"), RevisionRef("bot", 1))}
    assert asked[RevisionRef("bot")] == RevisionId("bot", 1)
    assert catalog.resolve(RevisionRef("bot", alias=CANDIDATE)).id == RevisionId("bot", 2)
    assert catalog.canary("bot") is None
    assert catalog.record(RevisionId("bot", 1)).aliases == (PRODUCTION,)

    registry.add("bot", 4)  # a new revision, production moved to it, a canary set
    registry.set("bot", share=10.0, production=4, canary=3)
    catalog.sync()
    assert catalog.resolve(RevisionRef("bot")).id == RevisionId("bot", 4)
    assert catalog.resolve(RevisionRef("bot", 4)).aliases == (PRODUCTION,)
    assert catalog.record(RevisionId("bot", 1)).aliases == ()  # its aliases too
    assert catalog.canary("bot") == (RevisionId("bot", 3), 10.0)

    registry.set("bot", share=None, production=3)  # the canary's share taken away
    catalog.sync()
    assert catalog.resolve(RevisionRef("bot", alias=PRODUCTION)).id == RevisionId("bot", 3)
    assert catalog.canary("bot") is None
    assert catalog.alias_target("bot", PRODUCTION) == 3


def test_an_adapter_reported_again_unchanged_is_no_change_and_keeps_its_answers(
    registry: MemoryRegistry, tmp_path: Path
) -> None:
    """A sync asks again for the last changes it saw (its overlap) and an audit reads every
    adapter: what comes back as the index holds it is not a change, so its answers stay."""
    catalog = Catalog(
        registry, base_digest=BASE, folder=tmp_path, audit_interval_s=0
    )  # every sync an audit
    production = RevisionRef.parse("bot@production")
    try:
        assert catalog.sync() == ["bot"]
        assert catalog.resolve(production).id == RevisionId("bot", 1)
        assert catalog.sync() == []
        assert catalog.cached(production) is not None

        registry.set("bot", production=2)
        assert catalog.sync() == ["bot"]
        assert catalog.cached(production) is None
        assert catalog.resolve(production).id == RevisionId("bot", 2)

        # Moved without moving the last-updated time (as by hand in MLflow's UI): the audit's
        # full read finds it.
        moved = dataclasses.replace(registry.adapters["bot"], aliases={PRODUCTION: 3})
        registry.adapters["bot"] = moved
        assert catalog.sync() == ["bot"]
        assert catalog.resolve(production).id == RevisionId("bot", 3)
    finally:
        catalog.close()


def test_an_answer_read_while_a_sync_writes_is_not_kept_past_it(
    registry: MemoryRegistry, catalog: Catalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    index_target = catalog.alias_target

    def sync_meanwhile(adapter: str, alias: str) -> int | None:
        """Reads the old target, then a sync moves it before the answer is kept."""
        found = index_target(adapter, alias)
        monkeypatch.setattr(catalog, "alias_target", index_target)
        registry.set("bot", production=2)
        catalog.sync()
        return found

    monkeypatch.setattr(catalog, "alias_target", sync_meanwhile)
    assert catalog.resolve(RevisionRef("bot")).id == RevisionId("bot", 1)  # asked before
    assert catalog.resolve(RevisionRef("bot")).id == RevisionId("bot", 2)  # the sync returned


def test_threads_reading_at_once_see_a_move_once_its_sync_returns(
    registry: MemoryRegistry, catalog: Catalog
) -> None:
    moved = threading.Event()
    stop = threading.Event()
    stale: list[RevisionId] = []
    refs = [RevisionRef("bot"), RevisionRef("bot", 1), RevisionRef("bot", alias=CANDIDATE)]

    def read() -> None:
        while not stop.is_set():
            after = moved.is_set()  # the sync had returned before this resolve started
            answer = catalog.resolve(RevisionRef("bot")).id
            if after and answer != RevisionId("bot", 3):
                stale.append(answer)
            for ref in refs[1:]:
                catalog.resolve(ref)

    threads = [threading.Thread(target=read) for _ in range(8)]
    for thread in threads:
        thread.start()
    for target in (2, 1, 2, 1, 3):
        registry.set("bot", production=target)
        catalog.sync()
    moved.set()
    time.sleep(0.3)
    stop.set()
    for thread in threads:
        thread.join()
    assert stale == []


def test_every_thread_reads_the_replacing_file(tmp_path: Path) -> None:
    index = CatalogIndex(tmp_path / "index.sqlite")
    index.put_adapters([AdapterAliases("a", {PRODUCTION: 1}, 1000, BASE)])
    other = CatalogIndex(tmp_path / "other.sqlite")
    other.put_adapters([AdapterAliases("a", {PRODUCTION: 7, CANARY: 8}, 2000, BASE, 5.0)])
    other.seal()
    other.close()

    barrier = threading.Barrier(5)
    seen: list[tuple[int | None, int | None]] = []

    def read() -> None:
        before = index.alias_target("a", PRODUCTION)  # this thread's reader opened
        barrier.wait()  # the file is replaced
        barrier.wait()
        seen.append((before, index.alias_target("a", PRODUCTION)))

    threads = [threading.Thread(target=read) for _ in range(4)]
    for thread in threads:
        thread.start()
    barrier.wait()
    index.replace_with(tmp_path / "other.sqlite")
    barrier.wait()
    for thread in threads:
        thread.join()
    assert seen == [(1, 7)] * 4
    assert index.canary("a") == (8, 5.0) and index.cursor_ms == 2000
    index.close()
    with pytest.raises(Exception, match="closed"):
        index.alias_target("a", PRODUCTION)
