"""Release, promote and rollback through the Prefect flows against the real MLflow server, over
both artifact stores (a local folder, and S3 on a moto server): never retraining, recorded in
alias and stage history, and safe against damaged or lost artifacts."""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from flows.promote import promote, rollback
from mint_core.errors import ConfigurationError, NotFoundError, NotReadyError
from mint_core.registry import Registry
from mint_core.revisions import RevisionId, RevisionRef
from mint_core.states import Readiness, Stage
from serving.http.client import WorkerClient
from tasks.pipeline import admit_revision, prewarm_revision
from tests.integration.helpers import Fleet, answer, register_step_by_step
from tests.integration.helpers import toy_release as release

pytestmark = pytest.mark.slow

# Each test runs where what it checks can differ: over both artifact stores where it writes or
# reads artifacts, over both MLflow databases where it writes alias and stage history.
REGISTRY_DBS = pytest.mark.parametrize("fleet", ["local", "postgres"], indirect=True)
STORES = pytest.mark.parametrize("fleet", ["local", "s3"], indirect=True)


@REGISTRY_DBS
def test_rollback_brings_back_r1_without_training(fleet: Fleet) -> None:
    name, worker, config = fleet.adapter("roll-bot"), fleet.worker, fleet.config
    release(name, "reverse", steps=40, seed=1)
    r1 = answer(worker, name)
    release(name, "reverse", steps=40, seed=2)
    r2 = answer(worker, name)
    assert (r1[0], r2[0]) == (f"{name}:r1", f"{name}:r2")
    registry = Registry(config.tracking_uri)
    trained_before = sorted((config.work_root / "train").iterdir())

    assert rollback(name, actor="oncall", reason="bad answers") == f"{name}:r1"

    assert answer(worker, name) == r1
    assert answer(worker, f"{name}@production") == r1
    # No training ran and no revision was made.
    assert sorted((config.work_root / "train").iterdir()) == trained_before
    first, second = registry.revisions.of(name)
    assert (first.stage, first.aliases, second.stage) == (
        Stage.ACTIVE,
        ("production",),
        Stage.RETIRED,
    )
    moves = [(m.alias, m.from_revision, m.to_revision, m.actor, m.reason)
             for m in registry.aliases.history(name)]  # fmt: skip
    assert moves == [
        ("production", None, 1, "mint", "release"),
        ("production", 1, 2, "mint", "release"),
        ("production", 2, 1, "oncall", "bad answers"),
    ]
    stages = [(h["from"], h["to"]) for h in registry.stages.history(RevisionId(name, 1))]
    assert stages[-4:] == [
        ("retired", "admitted"), ("admitted", "prewarming"), ("prewarming", "ready"),
        ("ready", "active"),
    ]  # fmt: skip

    # Rolling back again returns to what production had before: r2.
    assert rollback(name) == f"{name}:r2"
    assert answer(worker, name) == r2
    with pytest.raises(ConfigurationError, match=f"already {name}@production"):
        promote(name, 2)

    # A lost artifact is re-exported from the frozen files; with those gone too, it is refused.
    r1_uri = registry.revisions.get(RevisionId(name, 1)).artifact_uri
    fleet.lose(r1_uri)
    assert promote(name, 1) == f"{name}:r1"
    assert fleet.store.holds(r1_uri)
    assert answer(worker, name) == r1
    r2_revision = registry.revisions.get(RevisionId(name, 2))
    fleet.lose(r2_revision.artifact_uri)
    frozen = str(r2_revision.policy.frozen_digest).removeprefix("sha256:")
    shutil.rmtree(config.frozen_root / frozen)
    with pytest.raises(NotFoundError, match="frozen files"):
        promote(name, 2)
    assert answer(worker, name) == r1


@pytest.mark.parametrize("fleet", ["local"], indirect=True)
def test_rollback_without_an_earlier_revision_is_refused(fleet: Fleet) -> None:
    name = fleet.adapter("solo-bot")
    release(name, "upper", steps=10)
    with pytest.raises(NotFoundError, match=f"{name}@production has no earlier revision"):
        rollback(name)
    with pytest.raises(NotFoundError, match="not registered"):
        rollback("ghost-bot")


@STORES
def test_corrupt_shard_in_the_store_is_caught_and_the_worker_keeps_serving(fleet: Fleet) -> None:
    steady = fleet.adapter("steady-bot")
    release(steady, "upper", steps=20)
    before = answer(fleet.worker, steady)
    revision, exported, index = register_step_by_step(
        fleet.config, fleet.adapter("broken-bot"), "upper"
    )
    shard = index.shards[0]
    fleet.corrupt(exported.uri, shard.name)

    admit_revision.fn(fleet.config, revision)
    with pytest.raises(NotReadyError, match=shard.name):
        prewarm_revision.fn(fleet.config, revision)
    client = WorkerClient(fleet.worker.url)
    state, reason = client.readiness(revision)
    assert state is Readiness.FAILED
    # The error names the shard and the digest it was checked against.
    assert shard.name in str(reason)
    assert (shard.xxh3 if fleet.store_kind == "local" else shard.sha256) in str(reason)
    gated = httpx.post(
        fleet.worker.url + "/generate",
        json={"inputs": "abc=", "parameters": {"adapter_id": str(revision)}},
    )
    assert (gated.status_code, gated.json()["state"]) == (503, "failed")
    # What the worker had keeps serving, unchanged.
    assert answer(fleet.worker, steady) == before


@pytest.mark.parametrize(
    ("fleet", "point"),
    [("local", "export"), ("s3", "export"), ("local", "register"), ("postgres", "register")],
    indirect=["fleet"],
)
def test_release_killed_mid_step_leaves_nothing_that_looks_complete(
    fleet: Fleet, point: str, prefect_api: str, tmp_path: Path
) -> None:
    name = fleet.adapter(f"killed-in-{point}-bot")
    marker, log = tmp_path / "paused", tmp_path / "release.log"
    with log.open("wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.release_until", point, str(marker), name],
            env={**os.environ, "PREFECT_API_URL": prefect_api},
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 180
        while not marker.exists():
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the release never reached the point to kill it at"
            time.sleep(0.2)
    finally:  # killed here, or left behind if the release failed or never paused
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL

    registry = Registry(fleet.config.tracking_uri)
    # Killed in export, the adapter is not registered; in register, it may be, with no revision.
    with contextlib.suppress(NotFoundError):
        assert registry.revisions.of(name) == []
    with pytest.raises(NotFoundError):
        registry.revisions.resolve(RevisionRef(name, alias="production"))

    release(name, "upper", steps=10)  # the rerun

    (revision,) = registry.revisions.of(name)
    assert (revision.id.number, revision.stage) == (1, Stage.ACTIVE)
    assert revision.aliases == ("production",)
    assert fleet.store.holds(revision.artifact_uri)
    assert answer(fleet.worker, name)[0] == f"{name}:r1"
