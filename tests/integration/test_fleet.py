"""Admission, prewarm and activation across a fleet of two worker processes that follow their
own MLflow server: one revision prewarming at a time, 'not ready' answered at once, the alias
moved only when both workers are ready, and faults (a killed worker, a corrupt artifact,
MLflow going away) that cost users nothing."""

import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import cast

import httpx
import pytest

from control.services import start_mlflow
from mint_core.artifacts.stores import LocalArtifactStore
from mint_core.config import MintConfig
from mint_core.errors import NotFoundError, NotReadyError
from mint_core.model.base import BaseModel
from mint_core.registry import ACTIVATED_AT_TAG, Registry
from mint_core.revisions import CANDIDATE, RevisionId, RevisionRef
from mint_core.states import Stage
from processes import ManagedProcess, stop_all
from serving.http.client import WorkerClient
from serving.worker.server import start_worker
from tasks.pipeline import admit_revision, prewarm_revision
from tests.integration.helpers import (
    PREWARMING,
    activate,
    most_prewarming_at_once,
    register_random_adapter,
)

pytestmark = pytest.mark.slow


@dataclasses.dataclass
class Fleet:
    config: MintConfig
    mlflow: ManagedProcess
    workers: list[ManagedProcess]
    worker_configs: list[MintConfig]
    folder: Path
    registered: int = 0

    def register(self, base: BaseModel, name: str) -> RevisionId:
        self.registered += 1
        folder = self.folder / f"{name}-{self.registered}"
        return register_random_adapter(self.config, base, name, folder, seed=self.registered)

    def generate(self, worker: ManagedProcess, model: str) -> httpx.Response:
        body = {"inputs": "abc=", "parameters": {"adapter_id": model, "max_new_tokens": 4}}
        return httpx.post(worker.url + "/generate", json=body, timeout=30)

    def events(self, worker: ManagedProcess) -> list[dict[str, object]]:
        return httpx.get(worker.url + "/admin/events").json()["events"]


@pytest.fixture(scope="module")
def fleet(
    config: MintConfig,
    base: BaseModel,
    prefect_api: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Fleet]:
    """Two workers (admission K=1) over a registry of their own, which tests may stop. The
    first syncs with the registry only when nudged (POST /admin/sync), the second also every
    half second by itself. Activations take their adapter's roll-out slot from the session's
    Prefect server."""
    home = tmp_path_factory.mktemp("fleet-registry")
    mlflow = start_mlflow(home)
    fleet_config = dataclasses.replace(
        config, tracking_uri=mlflow.url, api_keys={}, worker_api_key="", admission_k=1
    )
    worker_configs = [
        # A leaving worker keeps listening a sync interval for its peers to notice, up to its
        # drain timeout: 2 s, or each stop of this one would take 30 s.
        dataclasses.replace(fleet_config, sync_interval_s=3600, drain_timeout_s=2.0),
        dataclasses.replace(fleet_config, sync_interval_s=0.5),
    ]
    fleet = Fleet(fleet_config, mlflow, [], worker_configs, home / "adapters")
    try:
        fleet.workers.extend(start_worker(worker_config) for worker_config in worker_configs)
        fleet.config = dataclasses.replace(
            fleet_config,
            sync_interval_s=0.5,
            worker_urls=tuple(w.url for w in fleet.workers),
            replicas=2,  # every revision on both workers: activation waits for both
        )
        yield fleet
    finally:
        # What the fleet holds now: tests restart a worker and the MLflow server.
        stop_all([*fleet.workers, fleet.mlflow])


def release(fleet: Fleet, revision: RevisionId) -> None:
    """The pipeline's last three steps."""
    admit_revision.fn(fleet.config, revision)
    prewarm_revision.fn(fleet.config, revision)
    activate(fleet.config, revision)


def queued_ahead(events: list[dict[str, object]], revision: str, at: float) -> int:
    """How many revisions a worker's event log has queued before `revision` (the queue keeps
    arrival order) and still queued at Unix time `at`."""
    arrivals = [event["id"] for event in events if event["state"] == "queued"]
    ahead = set(arrivals[: arrivals.index(revision)])
    states: dict[object, object] = {}
    for event in events:
        if event["id"] in ahead and cast(float, event["at"]) <= at:
            states[event["id"]] = event["state"]
    return sum(state == "queued" for state in states.values())


BURST_TRIES = 3
"""Bursts of ten the burst test sends until it asks for the last revision while it still waits
its turn: ten tiny prewarms take about 0.46 s idle, and on a loaded machine the test's own
request, sent once the sync returns, came after all ten (1 clean run in 5)."""


def test_a_burst_of_ten_prewarms_one_at_a_time_behind_a_fast_not_ready(
    fleet: Fleet, base: BaseModel
) -> None:
    registry = Registry(fleet.config.tracking_uri)
    for attempt in range(1, BURST_TRIES + 1):
        # Each try is the next revision of the ten adapters, pointed at as their candidate.
        revisions = [fleet.register(base, f"burst-{n}") for n in range(10)]
        for revision in revisions:
            registry.aliases.point(revision, CANDIDATE)
        # The first worker learns of all ten at one sync and admits them in one burst.
        assert len(WorkerClient(fleet.workers[0].url).sync()) == 10

        # The last one is still waiting its turn: 'not ready' comes at once, naming it.
        asked = time.time()
        started = time.perf_counter()
        gated = fleet.generate(fleet.workers[0], str(revisions[-1]))
        elapsed = time.perf_counter() - started
        answered = time.time()
        events = fleet.events(fleet.workers[0])
        if gated.status_code == 200:
            # Served only if the burst was over before the answer; then try again.
            ready_at = {e["id"]: e["at"] for e in events if e["state"] == "ready"}
            assert cast(float, ready_at[str(revisions[-1])]) <= answered, (gated.text, events)
            continue
        assert gated.status_code == 503, gated.text
        assert gated.headers["Retry-After"]
        body = gated.json()
        assert (body["adapter"], body["revision"]) == ("burst-9", attempt)
        assert body["state"] == "queued"
        # Its place counts the revisions queued before it and not yet started, as the event log
        # has them between the request and its answer; with K=1, one may have left the queue
        # just before its first prewarm event was logged.
        at_most = queued_ahead(events, str(revisions[-1]), asked)
        at_least = queued_ahead(events, str(revisions[-1]), answered) - 1
        assert at_least <= body["queue_position"] <= at_most, (body, at_least, at_most)
        assert elapsed < 1.0
        break
    else:
        pytest.fail(f"each of {BURST_TRIES} bursts was over before its last revision was asked for")

    for revision in revisions:
        admit_revision.fn(fleet.config, revision)
        prewarm_revision.fn(fleet.config, revision)

    for revision in revisions:
        activate(fleet.config, revision)
    for worker in fleet.workers:
        assert fleet.generate(worker, "burst-9@production").status_code == 200
        events = fleet.events(worker)
        assert most_prewarming_at_once(events) == 1
        # production never pointed at a revision this worker had not reported ready.
        ready_at = {e["id"]: e["at"] for e in events if e["state"] == "ready"}
        for revision in revisions:
            activated = registry.revisions.get(revision).tags[ACTIVATED_AT_TAG]
            assert ready_at[str(revision)] <= datetime.fromisoformat(activated).timestamp()


def test_activation_waits_until_both_workers_are_ready(fleet: Fleet, base: BaseModel) -> None:
    revision = fleet.register(base, "pair-bot")
    registry = Registry(fleet.config.tracking_uri)
    registry.stages.set(revision, Stage.ADMITTED)  # admitted on the first worker only
    first, second = (WorkerClient(w.url) for w in fleet.workers)
    first.admit(revision)
    first.wait_ready(revision, timeout_s=60)
    done = threading.Event()
    failure: list[BaseException] = []

    def activate_waiting() -> None:
        try:
            activate(fleet.config, revision, timeout_s=60)
        except BaseException as e:  # reported below
            failure.append(e)
        done.set()

    # The second worker has not admitted it: activation fails at once, alias untouched.
    with pytest.raises(NotReadyError, match=r"not_admitted"):
        activate(fleet.config, revision)
    with pytest.raises(NotFoundError):
        registry.revisions.resolve(RevisionRef("pair-bot"))

    # Queued on the second worker: activation waits for it, then moves the alias.
    second.admit(revision)
    thread = threading.Thread(target=activate_waiting)
    thread.start()
    done.wait(timeout=90)
    thread.join()
    assert failure == []
    assert second.readiness(revision)[0].value == "ready"
    assert registry.revisions.resolve(RevisionRef("pair-bot")).id == revision
    activated_at = datetime.fromisoformat(registry.revisions.get(revision).tags[ACTIVATED_AT_TAG])
    for worker in fleet.workers:
        ready = [e["at"] for e in fleet.events(worker) if e == e | {"id": "pair-bot:r1",
                                                                  "state": "ready"}]  # fmt: skip
        assert ready and ready[0] <= activated_at.timestamp()
    for worker in fleet.workers:
        response = fleet.generate(worker, "pair-bot@production")
        assert response.headers["X-Mint-Revision"] == "pair-bot:r1"


def test_a_corrupt_artifact_fails_on_both_workers_and_the_alias_stays(
    fleet: Fleet, base: BaseModel
) -> None:
    good = fleet.register(base, "careful-bot")
    release(fleet, good)
    bad = fleet.register(base, "careful-bot")
    registry = Registry(fleet.config.tracking_uri)
    folder = LocalArtifactStore(fleet.config.artifact_root).fetch(
        registry.revisions.get(bad).artifact_uri
    )
    shard = next(folder.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.chmod(0o644)
    shard.write_bytes(bytes(data))

    admit_revision.fn(fleet.config, bad)
    with pytest.raises(NotReadyError) as refused:
        prewarm_revision.fn(fleet.config, bad, timeout_s=60)
    message = str(refused.value)
    assert message.count("failed to prewarm careful-bot:r2") == 2
    assert "checksum" in message or "digest" in message
    assert registry.revisions.resolve(RevisionRef("careful-bot")).id == good
    for worker in fleet.workers:
        response = fleet.generate(worker, "careful-bot@production")
        assert response.headers["X-Mint-Revision"] == "careful-bot:r1"


def test_a_worker_killed_mid_prewarm_converges_after_restart(fleet: Fleet, base: BaseModel) -> None:
    revisions = [fleet.register(base, f"restart-{n}") for n in range(5)]
    registry = Registry(fleet.config.tracking_uri)
    for revision in revisions:
        registry.aliases.point(revision, CANDIDATE)
    victim = fleet.workers[0]  # it syncs when nudged: all five arrive at once
    assert set(WorkerClient(victim.url).sync()) == {str(r) for r in revisions}

    caught = poll(lambda: current_states(fleet.events(victim)) & PREWARMING, timeout_s=30)
    assert caught, "never saw a prewarm in progress"
    os.killpg(victim.process.pid, signal.SIGKILL)  # the worker and anything it forked, at once
    victim.stop()  # reaps it

    port = int(victim.url.rsplit(":", 1)[1])
    fleet.workers[0] = start_worker(fleet.worker_configs[0], port=port)  # as it was before
    # Nobody admits anything again: the restarted worker takes in every candidate by itself.
    client = WorkerClient(fleet.workers[0].url)
    deadline = time.monotonic() + 120
    while {client.readiness(r)[0].value for r in revisions} != {"ready"}:
        assert time.monotonic() < deadline, "the restarted worker did not converge"
        time.sleep(0.2)


def poll(probe: Callable[[], set[object]], timeout_s: float) -> set[object]:
    """`probe()` once it is non-empty, or what it gave when `timeout_s` ran out."""
    deadline = time.monotonic() + timeout_s
    while not (found := probe()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def current_states(events: list[dict[str, object]]) -> set[object]:
    states = {event["id"]: event["state"] for event in events}
    return set(states.values())


def test_mlflow_down_the_workers_keep_serving_degraded_and_catch_up_after(
    fleet: Fleet, base: BaseModel
) -> None:
    """Stops the fleet's MLflow server and starts it again on the same port and data, so the
    fleet is as it was for any test after this one."""
    release(fleet, fleet.register(base, "steady-bot"))

    port = int(fleet.mlflow.url.rsplit(":", 1)[1])
    registry_home = Path(str(fleet.mlflow.log_path)).parents[1]
    fleet.mlflow.stop()
    nudge(fleet.workers[0])  # the second notices by itself
    for worker in fleet.workers:
        wait_for_health(worker, "degraded")
        assert fleet.generate(worker, "steady-bot@production").status_code == 200

    fleet.mlflow = start_mlflow(registry_home, port=port)
    nudge(fleet.workers[0])
    for worker in fleet.workers:
        wait_for_health(worker, "ok")
    release(fleet, fleet.register(base, "steady-bot"))
    for worker in fleet.workers:
        response = fleet.generate(worker, "steady-bot@production")
        assert response.headers["X-Mint-Revision"] == "steady-bot:r2"


def nudge(worker: ManagedProcess) -> None:
    httpx.post(worker.url + "/admin/sync", timeout=60)


def wait_for_health(worker: ManagedProcess, status: str) -> None:
    deadline = time.monotonic() + 60
    while httpx.get(worker.url + "/health").json()["status"] != status:
        assert time.monotonic() < deadline, f"{worker.url} never reported {status}"
        time.sleep(0.2)
