"""Promote and rollback of existing revisions through the Prefect flows, against the real
MLflow server and worker of the session: never retraining, recorded in alias and stage
history."""

import shutil

import httpx
import pytest

from flows.promote import promote, rollback
from flows.release import release
from mint_core.artifact_store import LocalArtifactStore
from mint_core.config import MintConfig
from mint_core.errors import ConfigurationError, NotFoundError
from mint_core.registry import Registry
from mint_core.revisions import RevisionId
from mint_core.services import ManagedProcess
from mint_core.states import Stage

pytestmark = pytest.mark.slow


def answer(worker: ManagedProcess, adapter_id: str) -> tuple[str, list[float]]:
    """The revision that answered and its token log-probabilities: a fingerprint of weights."""
    body = {"inputs": "hello=", "parameters": {"adapter_id": adapter_id, "details": True}}
    response = httpx.post(worker.url + "/generate", json=body)
    response.raise_for_status()
    logprobs = [token["logprob"] for token in response.json()["details"]["tokens"]]
    return response.headers["X-Mint-Revision"], logprobs


def test_rollback_brings_back_r1_without_training(
    worker: ManagedProcess, fleet_config: MintConfig
) -> None:
    release("roll-bot", "reverse", steps=40, seed=1)
    r1 = answer(worker, "roll-bot")
    release("roll-bot", "reverse", steps=40, seed=2)
    r2 = answer(worker, "roll-bot")
    assert (r1[0], r2[0]) == ("roll-bot:r1", "roll-bot:r2")
    registry = Registry(fleet_config.tracking_uri)
    trained_before = sorted((fleet_config.work_root / "train").iterdir())

    assert rollback("roll-bot", actor="oncall", reason="bad answers") == "roll-bot:r1"

    assert answer(worker, "roll-bot") == r1
    assert answer(worker, "roll-bot@production") == r1
    # No training ran and no revision was made.
    assert sorted((fleet_config.work_root / "train").iterdir()) == trained_before
    first, second = registry.revisions("roll-bot")
    assert (first.stage, first.aliases, second.stage) == (
        Stage.ACTIVE,
        ("production",),
        Stage.RETIRED,
    )
    moves = [(m.alias, m.from_revision, m.to_revision, m.actor, m.reason)
             for m in registry.alias_history("roll-bot")]  # fmt: skip
    assert moves == [
        ("production", None, 1, "mint", "release"),
        ("production", 1, 2, "mint", "release"),
        ("production", 2, 1, "oncall", "bad answers"),
    ]
    stages = [(h["from"], h["to"]) for h in registry.stage_history(RevisionId("roll-bot", 1))]
    assert stages[-4:] == [
        ("retired", "admitted"), ("admitted", "prewarming"), ("prewarming", "ready"),
        ("ready", "active"),
    ]  # fmt: skip

    # Rolling back again returns to what production had before: r2.
    assert rollback("roll-bot") == "roll-bot:r2"
    assert answer(worker, "roll-bot") == r2
    with pytest.raises(ConfigurationError, match="already roll-bot@production"):
        promote("roll-bot", 2)

    # A lost artifact is re-exported from the frozen files; with those gone too, it is refused.
    r1_uri = registry.get(RevisionId("roll-bot", 1)).artifact_uri
    store = LocalArtifactStore(fleet_config.artifact_root)
    shutil.rmtree(store.fetch(r1_uri))
    assert promote("roll-bot", 1) == "roll-bot:r1"
    assert store.fetch(r1_uri).is_dir()
    assert answer(worker, "roll-bot") == r1
    r2_revision = registry.get(RevisionId("roll-bot", 2))
    shutil.rmtree(store.fetch(r2_revision.artifact_uri))
    frozen = str(r2_revision.policy.frozen_digest).removeprefix("sha256:")
    shutil.rmtree(fleet_config.frozen_root / frozen)
    with pytest.raises(NotFoundError, match="frozen files"):
        promote("roll-bot", 2)
    assert answer(worker, "roll-bot") == r1


def test_rollback_without_an_earlier_revision_is_refused(
    worker: ManagedProcess, fleet_config: MintConfig
) -> None:
    release("solo-bot", "upper", steps=10)
    with pytest.raises(NotFoundError, match="solo-bot@production has no earlier revision"):
        rollback("solo-bot")
    with pytest.raises(NotFoundError, match="not registered"):
        rollback("ghost-bot")
