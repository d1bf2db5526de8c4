"""A canary over an MLflow registry held in memory (`tests.helpers.MemoryMlflow`): its share
goes out before its alias, its start and end are alias moves in the adapter's history, and a
share nobody set on purpose sends nothing anywhere."""

import pytest

from mint_core.errors import ConfigurationError
from mint_core.registry import CANARY_PERCENT_TAG, Registry, held_slot
from mint_core.revisions import CANARY, PRODUCTION, RevisionId
from tests.helpers import MemoryMlflow, memory_registry, register_in_memory

ADAPTER = "forms"


@pytest.fixture
def memory() -> tuple[Registry, MemoryMlflow]:
    registry, mlflow = memory_registry()
    (r1, _) = register_in_memory(registry, ADAPTER, 2)
    with held_slot(ADAPTER, "test") as slot:
        registry.aliases.move(r1, PRODUCTION, slot=slot)
    mlflow.writes.clear()
    return registry, mlflow


def start(registry: Registry, revision: RevisionId, percent: float) -> int | None:
    with held_slot(revision.adapter, "test") as slot:
        return registry.canary.start(revision, percent, reason="try it", slot=slot)


def end(registry: Registry, reason: str = "") -> RevisionId | None:
    with held_slot(ADAPTER, "test") as slot:
        return registry.canary.end(ADAPTER, reason=reason, slot=slot)


def test_a_canary_starts_with_its_share_then_its_alias(
    memory: tuple[Registry, MemoryMlflow],
) -> None:
    registry, mlflow = memory
    r2 = RevisionId(ADAPTER, 2)

    assert start(registry, r2, 12.5) is None

    methods = [method for method, _ in mlflow.writes]
    share = methods.index("set_registered_model_tag")
    assert mlflow.writes[share][1][1] == CANARY_PERCENT_TAG  # before anything of the move
    assert share < methods.index("set_registered_model_alias")
    assert registry.canary.current(ADAPTER) == (r2, 12.5)
    assert mlflow.models[ADAPTER].aliases == {PRODUCTION: 1, CANARY: 2}
    # A canary's move activates nothing.
    assert "mint.activated_at" not in mlflow.models[ADAPTER].versions[2].tags


def test_a_canary_ends_recorded_as_a_move_back_to_production(
    memory: tuple[Registry, MemoryMlflow],
) -> None:
    registry, mlflow = memory
    start(registry, RevisionId(ADAPTER, 2), 10)

    assert end(registry, "stopped: errors 3.0%") == RevisionId(ADAPTER, 2)

    assert registry.canary.current(ADAPTER) is None
    assert mlflow.models[ADAPTER].aliases == {PRODUCTION: 1}
    assert CANARY_PERCENT_TAG not in mlflow.models[ADAPTER].tags
    history = registry.aliases.history(ADAPTER)
    assert [(m.alias, m.from_revision, m.to_revision) for m in history] == [
        (PRODUCTION, None, 1),
        (CANARY, None, 2),
        (CANARY, 2, 1),
    ]
    assert history[-1].reason == "stopped: errors 3.0%"
    writes = len(mlflow.writes)
    assert end(registry) is None  # again: nothing to end, nothing written
    assert len(mlflow.writes) == writes


@pytest.mark.parametrize("percent", [0, -5, 100.5, float("nan")])
def test_a_share_out_of_range_is_refused_before_anything_is_written(
    memory: tuple[Registry, MemoryMlflow], percent: float
) -> None:
    registry, mlflow = memory
    with pytest.raises(ConfigurationError, match="not valid"):
        start(registry, RevisionId(ADAPTER, 2), percent)
    assert mlflow.writes == []


def test_a_share_set_by_hand_out_of_range_means_no_canary(
    memory: tuple[Registry, MemoryMlflow],
) -> None:
    registry, mlflow = memory
    start(registry, RevisionId(ADAPTER, 2), 10)
    mlflow.models[ADAPTER].tags[CANARY_PERCENT_TAG] = "250"  # edited in MLflow's UI
    assert registry.canary.current(ADAPTER) is None
    mlflow.models[ADAPTER].tags[CANARY_PERCENT_TAG] = "25"
    assert registry.canary.current(ADAPTER) == (RevisionId(ADAPTER, 2), 25.0)


def test_a_share_left_without_a_canary_is_removed_and_the_adapter_touched(
    memory: tuple[Registry, MemoryMlflow],
) -> None:
    registry, mlflow = memory
    mlflow.models[ADAPTER].tags[CANARY_PERCENT_TAG] = "10"  # its move never happened
    updated = mlflow.models[ADAPTER].updated_ms

    assert end(registry) is None

    assert CANARY_PERCENT_TAG not in mlflow.models[ADAPTER].tags
    assert mlflow.models[ADAPTER].updated_ms > updated  # workers see the share gone
