"""The gateway's routing answers a model name the catalog answered recently on the event loop,
without a thread hop, and goes to the catalog off the loop again once a sync changed that
adapter, and only that adapter (a real catalog, against a registry held in memory)."""

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from mint_core.catalog.catalog import Catalog
from mint_core.errors import NotFoundError
from mint_core.revisions import RevisionRef
from serving.gateway.app import Gateway
from tests.helpers import BASE_DIGEST, MemoryRegistry, make_policy

SERVED_BASE = make_policy().base_digest
"""The base of every revision a `MemoryRegistry` holds (its policies are `make_policy`'s)."""


@pytest.fixture
def registry() -> MemoryRegistry:
    registry = MemoryRegistry()
    for number in (1, 2):
        registry.add("bot", number)
    registry.set("bot", production=1)
    registry.clock_ms += 10_000  # bot's change is older than a sync asks for again
    registry.add("other", 1)
    registry.add("other", 2)
    return registry


@pytest.fixture
def catalog(registry: MemoryRegistry, tmp_path: Path) -> Iterator[Catalog]:
    catalog = Catalog(registry, base_digest=BASE_DIGEST, folder=tmp_path)
    catalog.sync()
    yield catalog
    catalog.close()


def gateway(catalog: Catalog, monkeypatch: pytest.MonkeyPatch) -> tuple[Gateway, list[str]]:
    """A gateway over `catalog`, with one worker serving bot:r1 and bot:r2, and the list of
    what it asked the catalog to resolve off the event loop."""
    gw = Gateway(["http://127.0.0.1:1"], catalog)
    worker = gw.fleet.workers[0]
    worker.update({"base_model": "acme/base", "base_digest": SERVED_BASE, "in_flight": 0,
                   "ready": ["bot:r1", "bot:r2"], "device_slots": []})  # fmt: skip
    hopped: list[str] = []
    resolve = catalog.resolve

    def counted(ref: RevisionRef) -> object:
        hopped.append(str(ref))
        return resolve(ref)

    monkeypatch.setattr(catalog, "resolve", counted)
    return gw, hopped


def routes(gw: Gateway, model: str) -> list[str | None]:
    async def three() -> list[str | None]:
        return [(await gw.route(model))[1] for _ in range(3)]

    return asyncio.run(three())


def test_a_resolved_name_is_answered_on_the_loop_until_a_sync_changes_its_adapter(
    catalog: Catalog, registry: MemoryRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    gw, hopped = gateway(catalog, monkeypatch)
    assert routes(gw, "bot@production") == ["bot:r1"] * 3
    assert routes(gw, "bot") == ["bot:r1"] * 3  # the same question: production by default
    assert hopped == ["bot@production"]
    registry.set("other", production=2)
    gw.sync_catalog()  # another adapter changed: bot's answer is still on the loop
    assert routes(gw, "bot@production") == ["bot:r1"] * 3
    assert hopped == ["bot@production"]

    registry.set("bot", production=2)  # the alias moved
    gw.sync_catalog()
    assert routes(gw, "bot@production") == ["bot:r2"] * 3
    assert hopped == ["bot@production"] * 2
    assert routes(gw, "bot:r1") == ["bot:r1"] * 3
    assert hopped == ["bot@production"] * 2 + ["bot:r1"]


def test_a_failed_resolution_is_never_kept(
    catalog: Catalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    gw, hopped = gateway(catalog, monkeypatch)
    for _ in range(2):
        with pytest.raises(NotFoundError):
            asyncio.run(gw.route("ghost@production"))
    assert hopped == ["ghost@production"] * 2
