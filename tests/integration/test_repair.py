"""Repairing a revision from its frozen files: exported again with any packing under the same
content digest, and a damaged production revision served again by every worker, its alias
unmoved."""

import dataclasses
import shutil
import time

import pytest
import torch

from flows.promote import promote
from flows.repair import RepairReport, repair
from mint_core.artifacts.packing import load, verify
from mint_core.artifacts.stores import LocalArtifactStore, open_store
from mint_core.config import MintConfig
from mint_core.errors import ConfigurationError
from mint_core.registry import Registry
from mint_core.revisions import PRODUCTION, RevisionId
from mint_core.states import Readiness, Stage
from serving.http.client import WorkerClient
from serving.worker.server import start_worker
from tasks.pipeline import ensure_exported
from tests.integration.helpers import Fleet, answer, register_step_by_step
from tests.integration.helpers import toy_release as release

pytestmark = pytest.mark.slow


def test_a_lost_artifact_is_exported_again_with_another_shard_size(config: MintConfig) -> None:
    revision, exported, first = register_step_by_step(config, "reshard-bot", "upper")
    store = open_store(config)
    assert isinstance(store, LocalArtifactStore)
    before = {k: t.clone() for k, t in load(store.fetch(exported.uri)).peft_state_dict().items()}
    shutil.rmtree(store.fetch(exported.uri))

    assert ensure_exported.fn(config, revision, shard_bytes=4096)

    again = verify(store.fetch(exported.uri))
    assert again.content_digest == first.content_digest == exported.content_digest
    assert len(first.shards) == 1 < len(again.shards)  # packed differently
    after = load(store.fetch(exported.uri)).peft_state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[key], before[key]) for key in before)
    assert not ensure_exported.fn(config, revision)  # intact now: nothing to do


def wait_for(client: WorkerClient, revision: RevisionId, state: Readiness) -> str | None:
    """The worker's reason once it reports `revision` in `state` (at most 300 s)."""
    deadline = time.monotonic() + 300
    while (now := client.readiness(revision))[0] is not state and time.monotonic() < deadline:
        time.sleep(0.2)
    assert now[0] is state, now
    return now[1]


def test_repair_serves_a_damaged_production_revision_again_without_moving_it(
    fleet: Fleet, config: MintConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = fleet.adapter("repair-bot")
    release(name, "upper", steps=20)
    revision = RevisionId(name, 1)
    served = answer(fleet.worker, name)
    registry = Registry(fleet.config.tracking_uri)
    registered = registry.revisions.get(revision)
    uri = registered.artifact_uri
    shard = verify(fleet.store.fetch(uri)).shards[0].name
    fleet.corrupt(uri, shard)
    assert not fleet.store.holds(uri)
    # A worker starting now (a restart, a new machine) has no copy of its own to fall back on.
    if fleet.store_kind == "s3":
        cached = registered.policy.content_digest.removeprefix("sha256:")
        shutil.rmtree(fleet.config.home / "s3-cache" / "sha256" / cached)
    fresh = start_worker(dataclasses.replace(fleet.config, api_keys=config.api_keys))
    try:
        client = WorkerClient(fresh.url, fleet.config.worker_api_key)
        reason = wait_for(client, revision, Readiness.FAILED)
        assert shard in str(reason)
        assert f"mint repair --adapter {name} --revision 1" in str(reason)
        # Promote cannot help with what production already is; it names the command that can.
        with pytest.raises(ConfigurationError, match=f"mint repair --adapter {name} --revision 1"):
            promote(name, 1)

        monkeypatch.setenv("MINT_WORKER_URLS", f"{fleet.worker.url},{fresh.url}")
        report = repair(name, 1, actor="oncall")

        assert report == RepairReport(str(revision), exported_again=True, workers=2)
        assert fleet.store.holds(uri)
        assert client.readiness(revision)[0] is Readiness.READY
        assert answer(fresh, name) == served
        assert answer(fleet.worker, name) == served
    finally:
        fresh.stop()
    repaired = registry.revisions.get(revision)
    assert (repaired.stage, repaired.aliases) == (Stage.ACTIVE, (PRODUCTION,))
    assert [(m.from_revision, m.to_revision) for m in registry.aliases.history(name)] == [(None, 1)]
    note = registry.stages.history(revision)[-1]
    assert (note["from"], note["to"], note["actor"], note["reason"]) == (
        "active",
        "active",
        "oncall",
        "repair: exported again from its frozen files; ready again on 2 workers",
    )
