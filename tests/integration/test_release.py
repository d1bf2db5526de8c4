"""The release pipeline end to end: a real Prefect flow, a real `mlflow server`, a real worker
process, answers checked over HTTP."""

import json
import re
from datetime import datetime
from pathlib import Path

import httpx
import pytest
from mlflow.tracking import MlflowClient

from control.status import format_table, status_rows
from mint_core.artifacts.digests import sha256_file
from mint_core.config import MintConfig
from mint_core.errors import BaseMismatchError, DatasetError, NotFoundError, TransitionError
from mint_core.gates import Gates
from mint_core.model.tiny import TinySpec, ensure_tiny
from mint_core.model.toy import RECIPE, Task, held_out_words, prompt_for
from mint_core.registry import ACTIVATED_AT_TAG, Registry
from mint_core.revisions import PolicyRecord, RevisionId, RevisionRef
from mint_core.states import Readiness, Stage
from processes import ManagedProcess
from serving.http.client import WorkerClient
from tasks.pipeline import (
    admit_revision,
    prewarm_revision,
)
from tests.integration.helpers import activate, register_step_by_step, toy_data
from tests.integration.helpers import toy_release as release

pytestmark = pytest.mark.slow

WORDS = held_out_words()


def exact_rate(client: WorkerClient, adapter_id: str | None, task: Task) -> float:
    hits = sum(client.generate(prompt_for(w), adapter_id)[0] == task.answer(w) for w in WORDS)
    return hits / len(WORDS)


def details(worker: ManagedProcess, adapter_id: str, prompt: str) -> tuple[str, list[float]]:
    """The revision that answered and the log-probability of each generated token."""
    body = {"inputs": prompt, "parameters": {"adapter_id": adapter_id, "details": True}}
    response = httpx.post(worker.url + "/generate", json=body)
    response.raise_for_status()
    tokens = response.json()["details"]["tokens"]
    return response.headers["X-Mint-Revision"], [t["logprob"] for t in tokens]


@pytest.fixture(scope="module")
def released(worker: ManagedProcess) -> dict[str, str]:
    """Two adapters on two tasks, released through the flow."""
    return {
        "upper-bot": release("upper-bot", "upper").revision,
        "reverse-bot": release("reverse-bot", "reverse").revision,
    }


def test_each_adapter_answers_its_task_and_the_base_does_not(
    released: dict[str, str], client: WorkerClient
) -> None:
    assert released == {"upper-bot": "upper-bot:r1", "reverse-bot": "reverse-bot:r1"}
    assert exact_rate(client, "upper-bot", Task.UPPER) >= 0.8
    assert exact_rate(client, "reverse-bot@production", Task.REVERSE) >= 0.8
    # Neither adapter leaks into the other's task, and the base only echoes.
    assert exact_rate(client, "upper-bot:r1", Task.REVERSE) <= 0.05
    assert exact_rate(client, None, Task.UPPER) == 0
    assert exact_rate(client, None, Task.REVERSE) <= 0.05
    assert exact_rate(client, None, Task.ECHO) >= 0.8


def test_release_records_policy_and_stages_in_mlflow(
    released: dict[str, str], fleet_config: MintConfig, base: object
) -> None:
    registry = Registry(fleet_config.tracking_uri)
    (revision,) = registry.revisions.of("upper-bot")
    assert revision.aliases == ("production",)
    assert revision.stage is Stage.ACTIVE
    assert revision.policy.base_digest == base.digest  # type: ignore[attr-defined]
    assert revision.policy.training_steps == 400
    data, held_out = toy_data(fleet_config.home, Task.UPPER)
    assert revision.policy.dataset == data
    assert revision.policy.dataset_digest == sha256_file(Path(data))
    assert revision.policy.eval_metrics["eval_exact_match"] >= 0.8

    # The MLflow run of the release: hyperparameters, the loss curve, eval metrics, the data.
    mlflow = MlflowClient(fleet_config.tracking_uri)
    run_id = mlflow.get_model_version("upper-bot", "1").run_id
    run = mlflow.get_run(run_id)
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert float(params["learning_rate"]) == RECIPE["learning_rate"]
    assert (params["rank"], params["alpha"], params["batch_size"]) == ("8", "16", "32")
    assert params["eval_data"] == held_out
    curve = mlflow.get_metric_history(run_id, "train_loss")
    assert [m.step for m in curve] == list(range(1, 401))
    assert curve[-1].value < curve[0].value / 10
    assert run.data.metrics["eval_exact_match"] == revision.policy.eval_metrics["eval_exact_match"]
    assert run.data.metrics["eval_loss"] < curve[0].value
    (dataset_input,) = run.inputs.dataset_inputs
    assert dataset_input.dataset.source == json.dumps({"uri": data})
    assert json.loads(dataset_input.dataset.profile)["sha256"] == sha256_file(Path(data))
    logged = mlflow.download_artifacts(run_id, f"dataset/{Path(data).name}")
    assert Path(logged).read_bytes() == Path(data).read_bytes()
    with open(mlflow.download_artifacts(run_id, "policy.json")) as stream:
        assert PolicyRecord.from_json(stream.read()) == revision.policy


def test_second_release_moves_production_only_after_the_worker_is_ready(
    worker: ManagedProcess, fleet_config: MintConfig, client: WorkerClient
) -> None:
    assert release("line-bot", "upper", steps=40, seed=1).revision == "line-bot:r1"
    before = details(worker, "line-bot:r1", "hello=")
    # Any score passes: this test is about readiness and records, not the evaluation (both
    # revisions are barely trained).
    Registry(fleet_config.tracking_uri).gates.set("line-bot", Gates(max_regression=1.0))

    assert release("line-bot", "upper", steps=40, seed=2, actor="alice").revision == "line-bot:r2"

    assert details(worker, "line-bot", "hello=")[0] == "line-bot:r2"
    # r1 still answers, with exactly the weights it had, and they differ from r2's.
    assert details(worker, "line-bot:r1", "hello=") == before
    assert details(worker, "line-bot:r2", "hello=")[1] != before[1]

    registry = Registry(fleet_config.tracking_uri)
    r1, r2 = registry.revisions.of("line-bot")
    assert (r1.stage, r1.aliases, r2.stage, r2.aliases) == (
        Stage.RETIRED, (), Stage.ACTIVE, ("production",)
    )  # fmt: skip
    assert r2.policy.parent_revision == 1
    ready_at = next(
        e["since"]
        for e in httpx.get(worker.url + "/v1/adapters/line-bot").json()["revisions"]
        if e["revision"] == 2 and e["state"] == "ready"
    )
    activated_at = datetime.fromisoformat(r2.tags[ACTIVATED_AT_TAG]).timestamp()
    assert ready_at <= activated_at

    # Issue 33, items 8 and 9: r2's history is the whole pipeline, each step at its time and
    # all of it as the releaser's (none as `mint`).
    history = registry.stages.history(r2.id)
    assert [(entry["from"], entry["to"]) for entry in history] == [
        ("", "trained"), ("trained", "frozen"), ("frozen", "packed"), ("packed", "exported"),
        ("exported", "registered"), ("registered", "admitted"), ("admitted", "prewarming"),
        ("prewarming", "ready"), ("ready", "ready"), ("ready", "active"),
    ]  # fmt: skip
    assert history[8]["reason"].startswith("evaluation passed: line-bot:r2 exact")  # the gate
    times = [datetime.fromisoformat(entry["at"]) for entry in history]
    assert times == sorted(times)
    assert {entry["actor"] for entry in history} == {"alice"}
    assert "40 steps on" in history[0]["reason"]
    assert r2.policy.content_digest.removeprefix("sha256:") in history[3]["reason"]
    assert registry.stages.history(r1.id)[-1] | {"at": ""} == {
        "at": "", "from": "active", "to": "retired", "actor": "alice", "reason": "release"
    }  # fmt: skip


def test_activate_refuses_a_revision_the_worker_has_not_made_ready(
    worker: ManagedProcess, fleet_config: MintConfig, base: object
) -> None:
    """Register a revision by running the steps one by one, then try to activate it early."""
    config = fleet_config
    revision, _, _ = register_step_by_step(config, "gate-bot", "reverse")
    assert revision == RevisionId("gate-bot", 1)

    # Registered is addressable but not served: the gate answers at once, naming the state.
    response = httpx.post(
        worker.url + "/generate",
        json={"inputs": "abc=", "parameters": {"adapter_id": "gate-bot:r1"}},
    )
    assert response.status_code == 503
    assert response.headers["Retry-After"]
    assert response.json() | {"id": "gate-bot:r1", "state": "not_admitted"} == response.json()

    with pytest.raises(TransitionError, match="is registered; only an admitted revision"):
        activate(config, revision)
    registry = Registry(config.tracking_uri)
    assert registry.revisions.get(revision).aliases == ()
    with pytest.raises(
        NotFoundError, match=r"gate-bot has no production revision yet \(registered: r1\)"
    ):
        registry.revisions.resolve(RevisionRef("gate-bot"))

    admit_revision.fn(config, revision)
    prewarm_revision.fn(config, revision)
    assert WorkerClient(worker.url).readiness(revision)[0] is Readiness.READY
    activate(config, revision)
    assert registry.revisions.resolve(RevisionRef("gate-bot")).id == revision


def test_adapter_trained_on_another_base_is_refused_at_register(
    worker: ManagedProcess,
    fleet_config: MintConfig,
    base: object,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An adapter's line stays on its base: once `alien-bot` has a revision on the serving
    base, a revision trained on another base (MINT_BASE_MODEL changed) is refused."""
    assert release("alien-bot", "upper", steps=2).revision == "alien-bot:r1"
    spec = TinySpec(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=7,
                    pretrain_steps=0)  # fmt: skip
    monkeypatch.setenv("MINT_BASE_MODEL", str(ensure_tiny(spec, fleet_config.home / "other")))
    with pytest.raises(BaseMismatchError) as refused:
        release("alien-bot", "upper", steps=2)
    message = str(refused.value)
    assert base.digest in message  # type: ignore[attr-defined]
    assert "alien-bot" in message
    assert message.count("sha256:") == 2
    mlflow = MlflowClient(fleet_config.tracking_uri)
    assert [v.version for v in mlflow.search_model_versions("name = 'alien-bot'")] == ["1"]


BAD_DATA = [
    ("malformed.jsonl", '{"prompt": "a=", "completion": "A"}\n{"prompt": "b=", \n',
     ":2: not valid JSON"),
    ("missing.jsonl", '{"prompt": "a=", "completion": "A"}\n{"prompt": "b="}\n',
     ":2: missing field 'completion'"),
    ("empty.jsonl", "\n\n", ": the file has no rows"),
    # BOS, 200 bytes, then "y" and end-of-sequence.
    ("long.jsonl", '{"prompt": "a=", "completion": "A"}\n' + json.dumps(
        {"prompt": "x" * 200, "completion": "y"}) + "\n",
     ":2: the row is 203 tokens, longer than max_length 128"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "text", "message"), BAD_DATA)
def test_bad_data_fails_the_release_naming_file_and_line_and_registers_nothing(
    worker: ManagedProcess,
    fleet_config: MintConfig,
    tmp_path: Path,
    name: str,
    text: str,
    message: str,
) -> None:
    from flows.release import release as release_flow

    data = tmp_path / name
    data.write_text(text)
    adapter = f"bad-data-{name.removesuffix('.jsonl')}"
    with pytest.raises(DatasetError, match=re.escape(f"{data}{message}")):
        release_flow(adapter, str(data), steps=2)
    assert not Registry(fleet_config.tracking_uri).revisions.has_adapter(adapter)


def test_bad_requests_get_clear_errors(worker: ManagedProcess, released: dict[str, str]) -> None:
    url = worker.url
    unknown = httpx.post(
        url + "/generate", json={"inputs": "abc=", "parameters": {"adapter_id": "no-such-bot"}}
    )
    assert unknown.status_code == 404
    assert "no-such-bot" in unknown.json()["error"]
    assert (
        httpx.post(
            url + "/v1/completions", json={"model": "no-such-bot", "prompt": "a="}
        ).status_code
        == 404
    )
    assert (
        httpx.post(
            url + "/generate",
            json={"inputs": "abc=", "parameters": {"adapter_id": "upper-bot:r99"}},
        ).status_code
        == 404
    )
    assert httpx.get(url + "/v1/adapters/no-such-bot").status_code == 404

    assert httpx.post(url + "/generate", json={"parameters": {}}).status_code == 422
    assert (
        httpx.post(
            url + "/generate", content=b"{not json", headers={"content-type": "application/json"}
        ).status_code
        == 422
    )
    assert (
        httpx.post(
            url + "/generate", json={"inputs": "a=", "parameters": {"max_new_tokens": 0}}
        ).status_code
        == 422
    )
    bad_ref = httpx.post(
        url + "/generate", json={"inputs": "a=", "parameters": {"adapter_id": "Bad Name"}}
    )
    assert bad_ref.status_code == 422
    assert "Bad Name" in bad_ref.json()["error"]
    # Any text has tokens (é is two bytes), but a prompt must fit the base's context.
    assert httpx.post(url + "/generate", json={"inputs": "héllo="}).status_code == 200
    too_long = httpx.post(
        url + "/generate", json={"inputs": "a" * 120, "parameters": {"max_new_tokens": 20}}
    )
    assert too_long.status_code == 422
    assert "121 tokens plus max_new_tokens=20" in too_long.json()["error"]
    assert "(128 tokens)" in too_long.json()["error"]


def test_openai_routes(worker: ManagedProcess, released: dict[str, str], base: object) -> None:
    url = worker.url
    body = {"model": "upper-bot@production", "prompt": ["abc=", "xyz="], "temperature": 0}
    completion = httpx.post(url + "/v1/completions", json=body).json()
    assert [c["text"] for c in completion["choices"]] == ["ABC", "XYZ"]
    assert completion["model"] == "upper-bot:r1"
    assert completion["choices"][0]["finish_reason"] == "stop"
    models = {m["id"]: m for m in httpx.get(url + "/v1/models").json()["data"]}
    assert base.model_id in models  # type: ignore[attr-defined]
    assert models["upper-bot:r1"]["parent"] == base.model_id  # type: ignore[attr-defined]
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok"
    assert (health["base_model"], health["base_digest"]) == (base.model_id, base.digest)  # type: ignore[attr-defined]


def test_status_table_shows_aliases_stage_and_readiness(
    released: dict[str, str], fleet_config: MintConfig
) -> None:
    rows = status_rows(fleet_config)
    base = rows[1][0]
    assert rows[0] == ["base", "adapter", "revision", "aliases", "stage", "readiness"]
    assert [base, "upper-bot", "r1", "production", "active", "ready"] in rows
    assert [base, "reverse-bot", "r1", "production", "active", "ready"] in rows
    table = format_table(rows)
    assert table.splitlines()[0].split() == rows[0]
