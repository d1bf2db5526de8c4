"""What registering and activating cost in MLflow requests, against the real MLflow server, and
that doing them in fewer keeps what they guarantee: a revision is created whole (policy record,
stage and extra tags with its model version) or not at all; its run is named after it; an
activation walks the stages in order and lets workers in as soon as the alias has moved."""

import json
import uuid
from collections.abc import Iterator
from typing import Any

import mlflow
import pytest
import requests
from mlflow.tracking import MlflowClient

from mint_core.artifacts.digests import sha256_json
from mint_core.errors import RegistryError
from mint_core.registry import (
    REVISION_RUN_TAG,
    STAGE_HISTORY_TAG,
    DatasetLog,
    Registry,
    StageMark,
)
from mint_core.registry.stage_log import UNREGISTERED
from mint_core.revisions import PRODUCTION, RevisionRef
from mint_core.states import Stage
from processes import ManagedProcess
from tasks.pipeline import rollout_lock
from tests.helpers import make_policy


@pytest.fixture
def registry(mlflow_server: ManagedProcess) -> Registry:
    return Registry(mlflow_server.url)


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The HTTP requests this process sends from now on (MLflow's client uses `requests`)."""
    requests_sent: list[str] = []
    send = requests.Session.send

    def counted(session: requests.Session, request: Any, **kwargs: Any) -> Any:
        requests_sent.append(f"{request.method} {request.path_url.split('?')[0]}")
        return send(session, request, **kwargs)

    monkeypatch.setattr(requests.Session, "send", counted)
    yield requests_sent


def policy_of(adapter: str, number: int) -> Any:
    return make_policy(adapter=adapter, content_digest=sha256_json([adapter, number]))


def uri_of(policy: Any) -> str:
    return "mint-local://sha256/" + policy.content_digest.removeprefix("sha256:")


def test_registering_sends_few_requests_and_writes_the_revision_whole(
    registry: Registry, sent: list[str], mlflow_server: ManagedProcess
) -> None:
    adapter = f"counted-{uuid.uuid4().hex[:8]}"
    first = policy_of(adapter, 1)
    registry.revisions.register(first, uri_of(first), first.base_digest)

    sent.clear()
    imported = policy_of(adapter, 2)
    r2 = registry.revisions.register(
        imported, uri_of(imported), imported.base_digest, tags={"x.k": "v"}
    )
    # look up the adapter, who may write it (issue 48: none but the pipeline and admins),
    # create the run, the policy file, the version, name the run, end it
    assert len(sent) == 7, sent
    assert "GET /api/2.0/mint/registered-models/grants" in sent

    run_id = registry.runs.start_training(adapter, {"rank": "8"}, DatasetLog("/d.jsonl", "x", 1))
    registry.runs.finish_training(run_id, {"eval_loss": 0.5}, 10)
    sent.clear()
    trained = policy_of(adapter, 3)
    reached = [StageMark.reached(stage, f"{stage} step") for stage in UNREGISTERED]
    r3 = registry.revisions.register(
        trained, uri_of(trained), trained.base_digest, run_id, None, reached
    )
    # the same less the run's creation and end, plus MLflow's read of where its files go: the
    # steps before registration go into its history with the version, costing no request
    assert len(sent) == 6, sent

    # Issue 33, item 9: the whole pipeline is in the revision's history, each step with its time.
    history = registry.stages.history(r3.id)
    assert [(entry["from"], entry["to"]) for entry in history] == [
        ("", "trained"), ("trained", "frozen"), ("frozen", "packed"), ("packed", "exported"),
        ("exported", "registered"),
    ]  # fmt: skip
    assert [entry["at"] for entry in history[:4]] == [mark.at for mark in reached]
    assert [entry["at"] for entry in history] == sorted(entry["at"] for entry in history)
    assert {entry["actor"] for entry in history} == {trained.created_by}
    table = MlflowClient(mlflow_server.url).get_model_version(adapter, "3").description
    events = [line.split(" | ")[1] for line in table.splitlines() if line.startswith("| 20")]
    assert events == ["trained", "trained → frozen", "frozen → packed", "packed → exported",
                      "exported → registered"]  # fmt: skip
    # Without the steps (a caller that registers by hand), history starts at registered.
    assert [(e["from"], e["to"]) for e in registry.stages.history(r2.id)] == [("", "registered")]

    client = MlflowClient(mlflow_server.url)
    for revision, policy in ((r2, imported), (r3, trained)):
        got = registry.revisions.get(revision.id)
        assert got.policy == policy and got.stage is Stage.REGISTERED
        version = client.get_model_version(adapter, str(revision.id.number))
        run = client.get_run(version.run_id)
        assert run.info.run_name == str(revision.id)
        assert run.data.tags[REVISION_RUN_TAG] == str(revision.id)
        assert run.info.status == "FINISHED"
        path = mlflow.artifacts.download_artifacts(
            run_id=run.info.run_id, artifact_path="policy.json", tracking_uri=mlflow_server.url
        )
        with open(path) as stream:
            assert json.load(stream) == json.loads(policy.to_json())
    assert registry.revisions.get(r2.id).tags["x.k"] == "v"
    imported_run = client.get_model_version(adapter, str(r2.id.number)).run_id
    assert client.get_run(imported_run).data.metrics == imported.eval_metrics


def test_a_version_that_cannot_be_created_leaves_no_revision_and_a_failed_run(
    registry: Registry, mlflow_server: ManagedProcess
) -> None:
    adapter = f"refused-{uuid.uuid4().hex[:8]}"
    policy = policy_of(adapter, 1)
    registry.revisions.register(policy, uri_of(policy), policy.base_digest)
    second = policy_of(adapter, 2)
    with pytest.raises(RegistryError, match="Invalid model version source"):
        registry.revisions.register(second, "mint-local://x", second.base_digest)
    assert [r.id.number for r in registry.revisions.of(adapter)] == [1]
    client = MlflowClient(mlflow_server.url)
    runs = client.search_runs(
        [client.get_experiment_by_name("mint-releases").experiment_id],
        f"tags.`mint.adapter` = '{adapter}'",
    )
    assert sorted(run.info.status for run in runs) == ["FAILED", "FINISHED"]


def test_activation_walks_the_stages_in_order_and_lets_workers_in_once_the_alias_moved(
    registry: Registry, mlflow_server: ManagedProcess, prefect_api: str
) -> None:
    adapter = f"walked-{uuid.uuid4().hex[:8]}"
    policy = policy_of(adapter, 1)
    revision = registry.revisions.register(policy, uri_of(policy), policy.base_digest).id
    registry.stages.set(revision, Stage.ADMITTED)
    seen: list[int] = []

    def moved() -> None:  # what a worker reads when nudged: the alias, already moved
        seen.append(Registry(mlflow_server.url).revisions.resolve(RevisionRef(adapter)).id.number)

    with rollout_lock(adapter) as slot:
        assert (
            registry.aliases.activate(registry.revisions.get(revision), moved=moved, slot=slot)
            is None
        )
    assert seen == [1]
    registered = registry.revisions.get(revision)
    assert registered.stage is Stage.ACTIVE and registered.aliases == (PRODUCTION,)
    walk = [(m["from"], m["to"]) for m in json.loads(registered.tags[STAGE_HISTORY_TAG])]
    assert walk == [
        ("", "registered"), ("registered", "admitted"), ("admitted", "prewarming"),
        ("prewarming", "ready"), ("ready", "active"),
    ]  # fmt: skip
