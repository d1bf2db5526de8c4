"""What a catalog does with names the registry does not have (`mint_core.catalog.absent`): one
question per unknown adapter, whatever it is asked as, answered from memory after that until a
sync sees the adapter or the answer is old; a registry that cannot answer is said to be
unavailable without its address. Against a registry held in memory that counts questions."""

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mint_core.catalog.absent import Absent
from mint_core.catalog.catalog import Catalog
from mint_core.errors import NotFoundError, RegistryError
from mint_core.revisions import RevisionId, RevisionRef
from tests.helpers import BASE_DIGEST, MemoryRegistry


class CountingRegistry(MemoryRegistry):
    """Counts the questions about single adapters: what MLflow would be asked per name."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0
        self.down = False
        self.answering = threading.Event()
        self.answering.set()

    def has_adapter(self, adapter: str) -> bool:
        self.asked += 1
        self.answering.wait(5)
        if self.down:
            raise RegistryError("MLflow at http://10.0.0.7:5000 failed: 403 Permission denied")
        return super().has_adapter(adapter)


@pytest.fixture
def registry() -> CountingRegistry:
    registry = CountingRegistry()
    registry.add("bot", 1)
    registry.set("bot", production=1)
    return registry


@pytest.fixture
def catalog(registry: CountingRegistry, tmp_path: Path) -> Iterator[Catalog]:
    catalog = Catalog(registry, base_digest=BASE_DIGEST, folder=tmp_path)
    catalog.sync()
    yield catalog
    catalog.close()


def test_an_unknown_adapter_is_asked_about_once_until_a_sync_sees_it(
    registry: CountingRegistry, catalog: Catalog
) -> None:
    for ref in ("nobody", "nobody@canary", "nobody:r3", "nobody"):
        with pytest.raises(NotFoundError, match="'nobody' is not registered"):
            catalog.resolve(RevisionRef.parse(ref))
    assert not catalog.knows("nobody")
    assert (registry.asked, catalog.lookups) == (1, 1)
    assert catalog.absent_answers == 4

    registry.add("nobody", 1)
    registry.set("nobody", production=1)
    with pytest.raises(NotFoundError):  # the recent answer stands until a sync
        catalog.resolve(RevisionRef.parse("nobody"))
    catalog.sync()
    assert catalog.resolve(RevisionRef.parse("nobody")).id == RevisionId("nobody", 1)
    assert registry.asked == 1  # the sync brought it: nothing more asked


def test_concurrent_asks_about_one_unknown_name_share_one_question(
    registry: CountingRegistry, catalog: Catalog
) -> None:
    registry.answering.clear()  # every caller arrives while the first question is out
    failures: list[BaseException] = []

    def ask() -> None:
        try:
            catalog.resolve(RevisionRef.parse("ghost"))
        except NotFoundError as e:
            failures.append(e)

    threads = [threading.Thread(target=ask) for _ in range(20)]
    for thread in threads:
        thread.start()
    time.sleep(0.2)
    registry.answering.set()
    for thread in threads:
        thread.join()
    assert len(failures) == 20
    assert registry.asked == 1


def test_a_registry_that_cannot_answer_is_unavailable_in_the_callers_terms(
    registry: CountingRegistry, catalog: Catalog
) -> None:
    registry.down = True
    with pytest.raises(RegistryError) as refused:
        catalog.resolve(RevisionRef.parse("ghost"))
    message = str(refused.value)
    assert "registry is unavailable" in message and "ghost" in message
    assert "10.0.0.7" not in message and "403" not in message
    assert refused.value.__cause__ is None
    registry.down = False  # not kept: asked again next time
    with pytest.raises(NotFoundError):
        catalog.resolve(RevisionRef.parse("ghost"))
    assert registry.asked == 2


def test_absent_names_expire_and_are_bounded() -> None:
    absent = Absent(ttl_s=0.2, limit=2)
    absent.keep("a", "a", NotFoundError("adapter 'a' is not registered"))
    with pytest.raises(NotFoundError, match="'a'"):
        absent.check("a")
    time.sleep(0.3)
    absent.check("a")  # expired: nothing raised
    for name in ("b", "c", "d"):
        absent.keep(name, name, NotFoundError(name))
    absent.check("b")  # the oldest went when a third came
    with pytest.raises(NotFoundError):
        absent.check("d")
    absent.forget(["d"])
    absent.check("d")
