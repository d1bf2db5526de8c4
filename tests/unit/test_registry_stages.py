"""A revision's stage over an MLflow registry held in memory (`tests.helpers.MemoryMlflow`):
moves walk the stage table, a refused move writes nothing, and every move and note is in the
revision's history, written as its tag and its description's table."""

import json

import pytest

from mint_core.errors import TransitionError
from mint_core.registry import FAILURE_TAG, STAGE_HISTORY_TAG, STAGE_TAG, Registry
from mint_core.revisions import RevisionId
from mint_core.states import Stage
from tests.helpers import MemoryMlflow, memory_registry, register_in_memory

ADAPTER = "forms"


@pytest.fixture
def memory() -> tuple[Registry, MemoryMlflow]:
    return memory_registry()


def moved(registry: Registry, revision_number: int = 1) -> list[tuple[str, str]]:
    history = registry.stages.history(RevisionId(ADAPTER, revision_number))
    return [(entry["from"], entry["to"]) for entry in history]


def test_a_walk_is_checked_at_each_step_and_written_once(
    memory: tuple[Registry, MemoryMlflow],
) -> None:
    registry, mlflow = memory
    (r1,) = register_in_memory(registry, ADAPTER, 1)
    mlflow.writes.clear()

    walked = registry.stages.walk(
        r1, (Stage.ADMITTED, Stage.PREWARMING, Stage.READY), "fleet", "warm"
    )

    assert walked.stage is Stage.READY
    # The stage, the history and the description once each, however many steps.
    assert [method for method, _ in mlflow.writes] == [
        "set_model_version_tag",
        "set_model_version_tag",
        "update_model_version",
    ]
    stored = mlflow.models[ADAPTER].versions[1]
    assert stored.tags[STAGE_TAG] == "ready"
    assert walked.tags == {**walked.tags, **stored.tags}  # what it returns is what it wrote
    assert walked.description == stored.description and "prewarming" in stored.description
    assert moved(registry) == [
        ("", "registered"),
        ("registered", "admitted"),
        ("admitted", "prewarming"),
        ("prewarming", "ready"),
    ]
    entry = json.loads(stored.tags[STAGE_HISTORY_TAG])[-1]
    assert (entry["actor"], entry["reason"]) == ("fleet", "warm")


def test_a_refused_move_writes_nothing_and_names_where_it_could_go(
    memory: tuple[Registry, MemoryMlflow],
) -> None:
    registry, mlflow = memory
    (r1,) = register_in_memory(registry, ADAPTER, 1)
    writes = len(mlflow.writes)

    with pytest.raises(TransitionError, match="admitted"):
        registry.stages.set(r1, Stage.ACTIVE)
    # A walk refused at its last step writes none of the steps before it either.
    with pytest.raises(TransitionError):
        registry.stages.walk(r1, (Stage.ADMITTED, Stage.RETIRED))

    assert len(mlflow.writes) == writes
    assert registry.revisions.get(r1).stage is Stage.REGISTERED
    assert moved(registry) == [("", "registered")]


def test_a_note_keeps_the_stage_and_a_failure_keeps_its_reason(
    memory: tuple[Registry, MemoryMlflow],
) -> None:
    registry, mlflow = memory
    (r1,) = register_in_memory(registry, ADAPTER, 1)
    registry.stages.set(r1, Stage.ADMITTED, "fleet")

    registry.stages.note(r1, "oncall", "repaired its artifact", approver="alice")
    registry.stages.mark_failed(r1, "x" * 5000, "prewarm")

    history = registry.stages.history(r1)
    assert [(e["from"], e["to"]) for e in history] == [
        ("", "registered"),
        ("registered", "admitted"),
        ("admitted", "admitted"),
        ("admitted", "failed"),
    ]
    assert history[2]["approver"] == "alice" and history[2]["actor"] == "oncall"
    failed = registry.revisions.get(r1)
    assert failed.stage is Stage.FAILED
    assert failed.tags[FAILURE_TAG] == "x" * 4000  # cut, as in its history
    assert "approver" not in history[3]
    assert "repaired its artifact" in mlflow.models[ADAPTER].versions[1].description


def test_a_revision_read_once_walks_on_without_being_read_again(
    memory: tuple[Registry, MemoryMlflow],
) -> None:
    registry, mlflow = memory
    (r1,) = register_in_memory(registry, ADAPTER, 1)
    registered = registry.revisions.get(r1)
    reads = mlflow.calls["get_model_version"]

    admitted = registry.stages.set(registered, Stage.ADMITTED)
    registry.stages.set(admitted, Stage.PREWARMING)

    assert mlflow.calls["get_model_version"] == reads
    assert moved(registry)[-1] == ("admitted", "prewarming")
