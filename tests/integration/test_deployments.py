"""The flows as Prefect deployments: `mint flows serve` registers them with a running Prefect
server (parameters, cron schedule), a rollback run through the Prefect API changes what the
worker serves, a strict concurrency limit guards each adapter's roll-out, and persisted results
let a rerun of a flow run skip finished work. (`mint up`, which serves them, started and stopped
whole: tests/integration/test_mint_up.py.)"""

import os
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect import flow, get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
from prefect.deployments import run_deployment

from flows.deployments import start_flow_server
from mint_core.config import MintConfig
from mint_core.errors import ConfigurationError, RolloutBusyError
from mint_core.model.training import TrainingConfig
from mint_core.retraining import RetrainSchedule
from processes import ManagedProcess
from tasks.pipeline import rollout_lock
from tasks.training import load_data, train_adapter
from tests.integration.helpers import MINT, answer, toy_data
from tests.integration.helpers import toy_release as release

pytestmark = pytest.mark.slow

SCHEDULE = RetrainSchedule("nightly-bot", "/data/nightly.jsonl", "0 3 * * *")


@pytest.fixture(scope="module")
def flow_server(fleet_config: MintConfig, prefect_api: str) -> Iterator[ManagedProcess]:
    config = MintConfig(**{**vars(fleet_config), "retrain": (SCHEDULE,)})
    server = start_flow_server(config, prefect_api)
    yield server
    server.stop()


def test_deployments_are_served_with_parameters_and_schedule(flow_server: ManagedProcess) -> None:
    with get_client(sync_client=True) as client:
        deployments = {
            f"{client.read_flow(d.flow_id).name}/{d.name}": d for d in client.read_deployments()
        }
    assert {"release/release", "promote/promote", "rollback/rollback", "retrain/retrain",
            "retrain/retrain-nightly-bot", "rl/rl"} <= deployments.keys()  # fmt: skip
    rollback_form = deployments["rollback/rollback"].parameter_openapi_schema
    assert rollback_form["required"] == ["adapter", "actor"]
    assert {"adapter", "to_revision", "actor", "reason"} <= rollback_form["properties"].keys()
    release_form = deployments["release/release"].parameter_openapi_schema
    # Every hyperparameter is a field of the Prefect UI's form.
    hyperparameters = {"rank", "alpha", "target_modules", "dropout", "learning_rate",
                       "epochs", "steps", "batch_size", "gradient_accumulation",
                       "max_length", "seed"}  # fmt: skip
    assert {"adapter", "data", "eval_data", "eval_fraction", "principals"} | hyperparameters <= (
        release_form["properties"].keys()
    )
    assert release_form["required"] == ["adapter", "data", "actor"]
    nightly = deployments["retrain/retrain-nightly-bot"]
    # A scheduled retrain is recorded as the schedule's; one started from the form, as the
    # person who fills in `actor` (issue 33, item 8).
    assert nightly.parameters == {
        "adapter": "nightly-bot", "data": "/data/nightly.jsonl", "actor": "schedule"
    }  # fmt: skip
    retrain_form = deployments["retrain/retrain"].parameter_openapi_schema
    assert retrain_form["required"] == ["adapter", "data", "actor"]
    assert [s.schedule.cron for s in nightly.schedules] == ["0 3 * * *"]
    assert deployments["retrain/retrain"].schedules == []


def test_deployment_forms_guide_a_person(flow_server: ManagedProcess) -> None:
    """Each field of each form has help, an optional field is a field of its own type (not a
    choice between it and "None"), and who acts must be named: no default person."""
    with get_client(sync_client=True) as client:
        deployments = client.read_deployments()
    forms = {d.name: d.parameter_openapi_schema for d in deployments}
    # A run name typed in the form would be replaced by MinT's: the form says so.
    named = {d.name for d in deployments if "a name typed in the run form is not kept" in (
        d.description or "")}  # fmt: skip
    assert named == forms.keys()
    people = 0
    for name, form in forms.items():
        assert form is not None
        for field_name, field in form["properties"].items():
            where = f"{name}.{field_name}"
            assert field.get("description"), f"{where} has no description"
            assert "anyOf" not in field and field.get("type") != "null", f"{where}: {field}"
            if field_name in ("actor", "reviewer"):
                people += 1
                assert field_name in form["required"] and "default" not in field, where
    # release, import, promote, rollback, canary, repair, rl, retrain and its scheduled
    # deployment; approve's reviewer
    assert people == 10
    release = forms["release"]["properties"]
    assert release["steps"]["type"] == "integer" and "default" not in release["steps"]
    assert release["target_modules"]["type"] == "array"
    assert forms["approve"]["required"] == ["adapter", "revision", "reviewer"]


def test_rollback_through_the_prefect_api_changes_what_the_worker_serves(
    flow_server: ManagedProcess, worker: ManagedProcess
) -> None:
    release("ui-bot", "reverse", steps=20, seed=1)
    r1 = answer(worker, "ui-bot")
    release("ui-bot", "reverse", steps=20, seed=2)
    assert answer(worker, "ui-bot")[0] == "ui-bot:r2"

    run = run_deployment(
        "rollback/rollback",
        parameters={"adapter": "ui-bot", "actor": "dana", "reason": "from the UI"},
        timeout=300,
    )

    assert run.state is not None and run.state.is_completed(), run.state
    assert answer(worker, "ui-bot") == r1


def test_mint_rollback_and_promote_hand_their_run_to_the_flow_server(
    flow_server: ManagedProcess, worker: ManagedProcess, prefect_api: str
) -> None:
    """With the flows served, `mint rollback` and `mint promote` create a run of the deployment
    (it starts warm there, control.handoff) and print what it did and where its log is; a
    refused one fails with the run's reason. Before, each ran the flow in its own process,
    importing Prefect and MLflow first (issue 48)."""
    release("cli-bot", "reverse", steps=20, seed=1)
    r1 = answer(worker, "cli-bot")
    release("cli-bot", "reverse", steps=20, seed=2)
    env = os.environ | {"PREFECT_API_URL": prefect_api}

    def mint(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [MINT, *args, "--adapter", "cli-bot", "--actor", "erin"],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    done = mint("rollback")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rolled back cli-bot@production to cli-bot:r1" in done.stdout
    assert answer(worker, "cli-bot") == r1
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("rollback/rollback")
        (run,) = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_="rollback cli-bot"))
        )
    assert run.deployment_id == deployment.id and run.name == "rollback cli-bot r2→r1"
    assert f"/runs/flow-run/{run.id}" in done.stdout

    done = mint("promote", "--revision", "1")
    assert done.returncode == 1 and "cli-bot:r1 is already cli-bot@production" in done.stderr
    assert "/runs/flow-run/" in done.stderr  # where its log is
    done = mint("promote", "--revision", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert answer(worker, "cli-bot")[0] == "cli-bot:r2"


def test_an_adapter_rolls_out_one_release_at_a_time(prefect_api: str) -> None:
    entered = threading.Event()
    waited: list[float] = []

    def second() -> None:
        entered.wait()
        start = time.monotonic()
        with rollout_lock("lock-bot"):
            waited.append(time.monotonic() - start)

    thread = threading.Thread(target=second)
    thread.start()
    with rollout_lock("lock-bot"):
        entered.set()
        time.sleep(3)
    thread.join(60)
    assert waited and waited[0] >= 2.0
    with (
        rollout_lock("lock-bot"),
        pytest.raises(RolloutBusyError, match=r"slot of 'lock-bot' .* was busy for 1 s"),
        rollout_lock("lock-bot", timeout_s=1),
    ):
        pass


def test_a_rerun_of_a_flow_run_skips_finished_training(
    fleet_config: MintConfig, prefect_api: str
) -> None:
    @flow
    def train_twice() -> tuple[Path, Path]:
        training = TrainingConfig(steps=2, batch_size=4)
        data, held_out = load_data(fleet_config, *toy_data(fleet_config.home, "upper", 64), 0.1, 0)
        first = train_adapter(fleet_config, "cache-bot", data, held_out, training)
        again = train_adapter(fleet_config, "cache-bot", data, held_out, training)
        return first.path, again.path

    first, again = train_twice()
    assert first == again  # the second call, same run and inputs, reused the persisted result
    assert train_twice()[0] != first  # another run trains afresh


def test_flows_serve_needs_a_prefect_server(monkeypatch: pytest.MonkeyPatch) -> None:
    from mint_cli.flows import cmd_flows_serve

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with pytest.raises(ConfigurationError, match="PREFECT_API_URL"):
        cmd_flows_serve(None, MintConfig())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=re.escape("adapter|data file|<cron")):
        RetrainSchedule.parse_all("nightly-bot|/data/nightly.jsonl|every night")
    assert RetrainSchedule.parse_all(str(SCHEDULE)) == (SCHEDULE,)
