"""The gateway's routing answers a model name it has resolved since the catalog last changed
from memory, on the event loop, and asks the catalog again after any change."""

import asyncio
from dataclasses import dataclass, field

import pytest

from mint_core.errors import NotFoundError
from mint_core.revisions import RevisionId, RevisionRef
from serving.gateway.app import Gateway

DIGEST = "sha256:" + "d" * 64


@dataclass(frozen=True)
class _Policy:
    base_digest: str = DIGEST
    base_model_id: str = "acme/base"


@dataclass(frozen=True)
class _Registered:
    id: RevisionId
    policy: _Policy = _Policy()
    stage: str = "active"


@dataclass
class _Catalog:
    """What the gateway asks of a catalog: `production` names `number` until a sync moves it."""

    number: int = 1
    resolved: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    unreachable: str | None = None

    def resolve(self, ref: RevisionRef) -> _Registered:
        self.resolved.append(str(ref))
        if ref.adapter == "ghost":
            raise NotFoundError(f"no adapter {ref.adapter!r}")
        return _Registered(RevisionId(ref.adapter, ref.revision or self.number))

    def sync(self) -> list[str]:
        changed, self.changed = self.changed, []
        return changed

    def replicas(self, adapter: str) -> int:
        return 0

    def in_front_of_users(self, registered: _Registered) -> bool:
        return True


def gateway(catalog: _Catalog) -> Gateway:
    gw = Gateway(["http://127.0.0.1:1"], catalog)  # type: ignore[arg-type]
    worker = gw.fleet.workers[0]
    worker.update({"base_model": "acme/base", "base_digest": DIGEST, "in_flight": 0,
                   "ready": ["bot:r1", "bot:r2"], "device_slots": []})  # fmt: skip
    return gw


def test_a_resolved_name_is_answered_from_memory_until_the_catalog_changes() -> None:
    catalog = _Catalog()
    gw = gateway(catalog)

    async def routes() -> list[str | None]:
        return [(await gw.route("bot@production"))[1] for _ in range(3)]

    assert asyncio.run(routes()) == ["bot:r1"] * 3
    assert catalog.resolved == ["bot@production"]
    gw.sync_catalog()  # nothing changed: still from memory
    assert asyncio.run(routes()) == ["bot:r1"] * 3
    assert catalog.resolved == ["bot@production"]
    catalog.number, catalog.changed = 2, ["bot"]  # the alias moved
    gw.sync_catalog()
    assert asyncio.run(routes()) == ["bot:r2"] * 3
    assert catalog.resolved == ["bot@production"] * 2


def test_a_failed_resolution_is_never_kept() -> None:
    catalog = _Catalog()
    gw = gateway(catalog)
    for _ in range(2):
        with pytest.raises(NotFoundError):
            asyncio.run(gw.route("ghost@production"))
    assert catalog.resolved == ["ghost@production"] * 2
