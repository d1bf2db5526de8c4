"""Alias moves over an MLflow registry held in memory (`tests.helpers.MemoryMlflow`): the
record comes first as an intent, then the alias, then the record marked done, and a mover
killed at any write leaves history and alias agreeing. The same properties run against a real
server in tests/integration/test_alias_history.py; here each write is seen, in order."""

import pytest
from mlflow.exceptions import MlflowException

from mint_core.alias_intents import INTENT_TAG, AliasIntent
from mint_core.errors import NotFoundError, RegistryError, SlotNotHeldError
from mint_core.registry import ACTIVATED_AT_TAG, ALIAS_MOVE_TAG, MoveRecord, Registry, held_slot
from mint_core.revisions import CANDIDATE, PRODUCTION, RevisionId
from mint_core.states import Stage
from tests.helpers import MemoryMlflow, memory_registry, register_in_memory

ADAPTER = "forms"


class Crash(Exception):
    """The mover died here: this write and everything after it never ran."""


@pytest.fixture
def memory() -> tuple[Registry, MemoryMlflow]:
    return memory_registry()


def move(
    registry: Registry, revision: RevisionId, alias: str = PRODUCTION, **how: str
) -> int | None:
    with held_slot(revision.adapter, "test") as slot:
        return registry.aliases.move(revision, alias, slot=slot, **how)


def moves(registry: Registry) -> list[tuple[str, int | None, int]]:
    return [(m.alias, m.from_revision, m.to_revision) for m in registry.aliases.history(ADAPTER)]


def tag_key(method: str, args: tuple[object, ...]) -> object:
    """The key a tag write sets (a version's tag: name, version, key, value; a model's: name,
    key, value); None for another write."""
    if method == "set_model_version_tag":
        return args[2]
    return args[1] if method == "set_registered_model_tag" else None


def production(memory: MemoryMlflow) -> int | None:
    return memory.models[ADAPTER].aliases.get(PRODUCTION)


def test_a_move_writes_its_intent_then_the_alias_then_done(
    memory: tuple[Registry, MemoryMlflow],
) -> None:
    registry, mlflow = memory
    r1, r2 = register_in_memory(registry, ADAPTER, 2)
    assert move(registry, r1) is None
    mlflow.writes.clear()

    assert move(registry, r2, actor="oncall", reason="better", approver="alice") == 1

    tag = ALIAS_MOVE_TAG + "000002"
    written = [(method, tag_key(method, args)) for method, args in mlflow.writes]
    assert written == [
        ("set_model_version_tag", tag),  # the record, an intent
        ("set_registered_model_tag", INTENT_TAG + PRODUCTION),  # what workers follow
        ("set_registered_model_alias", None),
        ("set_registered_model_tag", INTENT_TAG + PRODUCTION),  # the intent done
        ("update_registered_model", None),  # the adapter's change time, its history table
        ("set_model_version_tag", ACTIVATED_AT_TAG),
        ("set_model_version_tag", tag),  # the record, done
        ("update_model_version", None),  # the version's history table
    ]
    first = MoveRecord.from_tag(str(mlflow.writes[0][1][3]))
    last = MoveRecord.from_tag(str(mlflow.writes[6][1][3]))
    assert not first.done and last.done and first.move == last.move
    assert (last.move.actor, last.move.reason, last.move.approver) == ("oncall", "better", "alice")
    intent = AliasIntent.from_tag(mlflow.models[ADAPTER].tags[INTENT_TAG + PRODUCTION])
    assert intent is not None and (intent.revision, intent.previous, intent.done) == (2, 1, True)
    assert production(mlflow) == 2
    assert moves(registry) == [(PRODUCTION, None, 1), (PRODUCTION, 1, 2)]
    assert registry.aliases.previous(ADAPTER) == r1
    version = mlflow.models[ADAPTER].versions[2]
    assert "oncall" in version.description and "oncall" in mlflow.models[ADAPTER].description


MOVE_WRITES = 8
"""Writes one alias move makes (see the test above)."""


@pytest.mark.parametrize("crash_at", range(1, MOVE_WRITES + 1))
def test_a_move_killed_at_any_write_leaves_history_and_alias_agreeing(
    memory: tuple[Registry, MemoryMlflow], crash_at: int
) -> None:
    registry, mlflow = memory
    r1, r2, r3 = register_in_memory(registry, ADAPTER, 3)
    move(registry, r1)
    move(registry, r2)
    before = len(mlflow.writes)

    def crash(method: str, _: int) -> Exception | None:
        return Crash(method) if len(mlflow.writes) - before == crash_at - 1 else None

    mlflow.fails = crash
    with pytest.raises(Crash):
        move(registry, r3, actor="oncall")
    mlflow.fails = lambda *_: None
    assert len(mlflow.writes) - before == crash_at - 1

    now = production(mlflow)
    assert now == (3 if crash_at > 3 else 2)  # the third write moves the alias
    expected = [(PRODUCTION, None, 1), (PRODUCTION, 1, 2)]
    if now == 3:
        expected.append((PRODUCTION, 2, 3))
    assert moves(registry) == expected
    assert registry.aliases.previous(ADAPTER).number == now - 1

    # Done again (if it did not happen), the move is recorded once, and so is the next.
    if now != 3:
        move(registry, r3)
    move(registry, r1)
    assert moves(registry) == [
        (PRODUCTION, None, 1),
        (PRODUCTION, 1, 2),
        (PRODUCTION, 2, 3),
        (PRODUCTION, 3, 1),
    ]
    assert registry.aliases.previous(ADAPTER) == r3


def test_an_error_reading_moves_nothing(memory: tuple[Registry, MemoryMlflow]) -> None:
    registry, mlflow = memory
    r1, r2 = register_in_memory(registry, ADAPTER, 2)
    move(registry, r1)
    busy = MlflowException("the database is busy", error_code="TEMPORARILY_UNAVAILABLE")
    mlflow.fails = lambda method, _: busy if method.startswith("search_") else None
    writes = len(mlflow.writes)

    with pytest.raises(RegistryError, match="the database is busy"):
        move(registry, r2)

    assert len(mlflow.writes) == writes
    mlflow.fails = lambda *_: None
    assert production(mlflow) == 1 and moves(registry) == [(PRODUCTION, None, 1)]


def test_a_move_needs_its_own_adapters_slot_before_anything(
    memory: tuple[Registry, MemoryMlflow],
) -> None:
    registry, mlflow = memory
    (r1,) = register_in_memory(registry, ADAPTER, 1)
    writes = len(mlflow.writes)
    with held_slot("another", "test") as slot, pytest.raises(SlotNotHeldError):
        registry.aliases.move(r1, PRODUCTION, slot=slot)
    with held_slot(ADAPTER, "test") as slot:
        pass
    with pytest.raises(SlotNotHeldError, match="let go"):
        registry.aliases.move(r1, PRODUCTION, slot=slot)
    assert len(mlflow.writes) == writes


def test_previous_names_no_revision_before_the_first(memory: tuple[Registry, MemoryMlflow]) -> None:
    registry, _ = memory
    (r1,) = register_in_memory(registry, ADAPTER, 1)
    with pytest.raises(NotFoundError, match="does not exist"):
        registry.aliases.previous(ADAPTER)
    move(registry, r1)
    with pytest.raises(NotFoundError, match="no earlier revision"):
        registry.aliases.previous(ADAPTER)


def test_activation_walks_to_active_moves_production_and_retires_the_one_before(
    memory: tuple[Registry, MemoryMlflow],
) -> None:
    registry, mlflow = memory
    r1, r2 = register_in_memory(registry, ADAPTER, 2)
    for revision in (r1, r2):
        registry.stages.set(revision, Stage.ADMITTED)
        registry.aliases.point(revision, CANDIDATE)
        with held_slot(ADAPTER, "test") as slot:
            registry.aliases.activate(registry.revisions.get(revision), slot=slot)

    assert registry.revisions.get(r2).stage is Stage.ACTIVE
    assert registry.revisions.get(r1).stage is Stage.RETIRED
    assert CANDIDATE not in mlflow.models[ADAPTER].aliases  # each roll-out over
    assert moves(registry) == [(PRODUCTION, None, 1), (PRODUCTION, 1, 2)]
    walked = [(e["from"], e["to"]) for e in registry.stages.history(r2)]
    assert walked == [
        ("", "registered"),
        ("registered", "admitted"),
        ("admitted", "prewarming"),
        ("prewarming", "ready"),
        ("ready", "active"),
    ]


def test_a_rejected_candidate_stops_being_the_candidate(
    memory: tuple[Registry, MemoryMlflow],
) -> None:
    registry, mlflow = memory
    (r1,) = register_in_memory(registry, ADAPTER, 1)
    registry.stages.walk(r1, (Stage.ADMITTED, Stage.PREWARMING, Stage.READY))
    registry.aliases.point(r1, CANDIDATE)
    assert mlflow.models[ADAPTER].aliases == {CANDIDATE: 1}

    registry.aliases.reject(r1, "eval", "too wrong")

    assert mlflow.models[ADAPTER].aliases == {}
    assert registry.revisions.get(r1).stage is Stage.REJECTED
    assert registry.aliases.history(ADAPTER) == []  # working aliases keep no history
    registry.aliases.drop(ADAPTER, CANDIDATE)  # dropping what is gone changes nothing
    registry.aliases.drop("never-registered", CANDIDATE)
