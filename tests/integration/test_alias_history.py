"""Alias moves and their history against the real MLflow server: errors surface, a move
interrupted at any write leaves history and alias agreeing, and history grows without bound
in tags a real database can hold."""

import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from mint_core.artifacts.digests import sha256_json
from mint_core.errors import RegistryError
from mint_core.registry import AliasMove, MoveRecord, Registry, moves_made
from mint_core.revisions import PRODUCTION, RevisionId, RevisionRef
from processes import ManagedProcess
from tasks.pipeline import rollout_lock
from tests.helpers import make_policy
from tests.integration.helpers import move_alias

REGISTERED_MODEL_TAG_LIMIT = 5000
"""MLflow's schema declares registered-model tag values `String(5000)`: PostgreSQL and MySQL
enforce it, sqlite does not, so the tests check it themselves."""
WRITES = frozenset(
    {
        "set_model_version_tag",
        "set_registered_model_alias",
        "set_registered_model_tag",
        "update_registered_model",
        "delete_registered_model_alias",
    }
)


@pytest.fixture
def registry(mlflow_server: ManagedProcess, prefect_api: str) -> Registry:
    """The session registry; `prefect_api` for the roll-out slots alias moves take."""
    return Registry(mlflow_server.url)


def register(registry: Registry, adapter: str, count: int) -> list[RevisionId]:
    """`count` revisions of `adapter` (metadata only: nothing is served)."""
    revisions = []
    for number in range(1, count + 1):
        policy = make_policy(adapter=adapter, content_digest=sha256_json([adapter, number]))
        uri = "mint-local://sha256/" + policy.content_digest.removeprefix("sha256:")
        revisions.append(registry.revisions.register(policy, uri, policy.base_digest).id)
    return revisions


def new_adapter(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def moves(registry: Registry, adapter: str) -> list[tuple[str, int | None, int]]:
    return [(m.alias, m.from_revision, m.to_revision) for m in registry.aliases.history(adapter)]


def production(registry: Registry, adapter: str) -> int:
    return registry.revisions.resolve(RevisionRef(adapter, alias=PRODUCTION)).id.number


class Crash(Exception):
    """The process moving the alias died here: this write and everything after never ran."""


Fault = Callable[[str, int], Exception | None]
"""(method, how many times it has been called) -> the error this call raises, or None."""


class FaultyClient:
    """The registry's MLflow client with one fault injected: `fails(method, call)` says whether
    this call of `method` fails instead of reaching the server."""

    def __init__(self, client: MlflowClient, fails: Fault) -> None:
        self._client = client
        self._fails = fails
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str) -> object:
        method = getattr(self._client, name)

        def call(*args: object, **kwargs: object) -> object:
            self.calls[name] = self.calls.get(name, 0) + 1
            error = self._fails(name, self.calls[name])
            if error is not None:
                raise error
            return method(*args, **kwargs)

        return call


@pytest.fixture
def inject(registry: Registry) -> Iterator[Callable[[Fault], None]]:
    healthy = registry.store.client

    def install(fails: Fault) -> None:
        registry.store.client = FaultyClient(healthy, fails)  # type: ignore[assignment]

    yield install
    registry.store.client = healthy


def test_an_error_reading_the_alias_moves_nothing(registry: Registry, inject: Callable) -> None:
    adapter = new_adapter("read-fails-bot")
    r1, r2 = register(registry, adapter, 2)
    move_alias(registry, r1, PRODUCTION)
    unavailable = MlflowException("the database is busy", error_code="TEMPORARILY_UNAVAILABLE")
    # Every read fails; writes still reach the server (a replica lagging, a flaky proxy).
    inject(lambda method, _: unavailable if method.startswith(("get_", "search_")) else None)

    with pytest.raises(RegistryError, match="the database is busy"):
        move_alias(registry, r2, PRODUCTION)

    inject(lambda *_: None)
    assert production(registry, adapter) == 1
    assert moves(registry, adapter) == [(PRODUCTION, None, 1)]


MOVE_WRITES = 7
"""Writes one alias move makes: its history record (an intent), the adapter's alias intent
(what workers follow), the alias, the alias intent marked done, the adapter's last-updated time
(workers find changes by it), the activation time, the record marked done."""


@pytest.mark.parametrize("crash_at", range(1, MOVE_WRITES + 1))
def test_a_move_killed_at_any_write_leaves_history_and_alias_agreeing(
    registry: Registry, inject: Callable, crash_at: int
) -> None:
    adapter = new_adapter(f"crash-{crash_at}-bot")
    r1, r2, r3 = register(registry, adapter, 3)
    move_alias(registry, r1, PRODUCTION)
    move_alias(registry, r2, PRODUCTION)
    writes = 0

    def crash(method: str, _: int) -> Exception | None:
        nonlocal writes
        writes += method in WRITES
        return Crash(f"killed at write {writes} ({method})") if writes == crash_at else None

    inject(crash)
    with pytest.raises(Crash):
        move_alias(registry, r3, PRODUCTION, actor="oncall")
    inject(lambda *_: None)

    # Wherever the alias is now, history ends there and rollback returns to where it was.
    now = production(registry, adapter)
    expected = [(PRODUCTION, None, 1), (PRODUCTION, 1, 2)]
    if now == 3:
        expected.append((PRODUCTION, 2, 3))
    assert moves(registry, adapter) == expected
    assert registry.aliases.previous(adapter).number == now - 1

    # The move done again (if it did not happen) is recorded once, and so is the one after it.
    if now != 3:
        move_alias(registry, r3, PRODUCTION)
    move_alias(registry, r1, PRODUCTION)
    assert moves(registry, adapter) == [
        (PRODUCTION, None, 1),
        (PRODUCTION, 1, 2),
        (PRODUCTION, 2, 3),
        (PRODUCTION, 3, 1),
    ]
    assert registry.aliases.previous(adapter) == r3


def test_history_keeps_done_moves_and_the_intents_the_alias_followed() -> None:
    def record(number: int, before: int | None, to: int, done: bool) -> MoveRecord:
        return MoveRecord(AliasMove(number, "", PRODUCTION, before, to, "", ""), done)

    records = [
        record(1, None, 1, done=True),
        record(2, 1, 2, done=True),
        record(3, 2, 3, done=False),  # killed before the alias moved: next seen at r2
        record(4, 2, 3, done=False),  # killed after it moved: next seen at r3
        record(5, 3, 1, done=True),
        # Someone moved it to r5 in the MLflow UI: the done move to r1 still happened.
        record(6, 5, 2, done=True),
        record(7, 2, 4, done=False),  # killed before the alias moved: it is at r2 now
    ]
    made = moves_made(records, {PRODUCTION: 2})
    assert [(m.number, m.from_revision, m.to_revision) for m in made] == [
        (1, None, 1),
        (2, 1, 2),
        (4, 2, 3),
        (5, 3, 1),
        (6, 5, 2),
    ]


@pytest.mark.slow
def test_two_hundred_moves_fit_a_real_database_and_read_back_in_order(
    registry: Registry,
) -> None:
    adapter = new_adapter("busy-bot")
    revisions = register(registry, adapter, 3)
    started = time.perf_counter()
    # One mover makes them all in its roll-out slot: the history is under test, not the slot
    # (taken per move, it added about a third to each).
    with rollout_lock(adapter) as slot:
        for step in range(200):
            registry.aliases.move(revisions[step % 3], PRODUCTION, f"actor-{step}", slot=slot)
    elapsed = time.perf_counter() - started

    history = registry.aliases.history(adapter)
    assert [(m.from_revision, m.to_revision, m.actor) for m in history] == [
        (None if step == 0 else (step - 1) % 3 + 1, step % 3 + 1, f"actor-{step}")
        for step in range(200)
    ]
    assert all(isinstance(m, AliasMove) for m in history)
    assert production(registry, adapter) == revisions[199 % 3].number
    assert registry.aliases.previous(adapter) == revisions[0]
    # Every tag MinT wrote fits the tightest column MLflow declares for a tag value.
    client = MlflowClient(registry.tracking_uri)
    tags = dict(client.get_registered_model(adapter).tags)
    for revision in revisions:
        tags |= client.get_model_version(adapter, str(revision.number)).tags
    longest = max(tags, key=lambda key: len(tags[key]))
    assert len(tags[longest]) < REGISTERED_MODEL_TAG_LIMIT, longest
    print(f"200 moves in {elapsed:.1f} s")
