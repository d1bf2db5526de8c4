"""What a flow run tells in the Prefect UI, read back through Prefect's client from the real
API: a name that says what it did, an `adapter:` tag, the key events in its log, and a summary
markdown artifact; a user's mistake ends the run Failed with one ERROR line, its message."""

import re
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from uuid import UUID

import pytest
from prefect import flow, get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.deployments import run_deployment
from prefect.states import State

from control.services import start_mlflow
from flows.deployments import start_flow_server
from flows.ending import ends_on_mint_error
from flows.promote import rollback
from flows.repair import repair
from mint_core.config import MintConfig
from mint_core.errors import NotFoundError
from mint_core.gates import Gates
from mint_core.registry import Registry
from mint_core.registry_accounts import RegistryAccounts
from processes import ManagedProcess
from tests.integration.helpers import run_logs, run_markdown
from tests.integration.helpers import toy_release as release

pytestmark = pytest.mark.slow

ADAPTER = "told-bot"


def run_id(state: State) -> UUID:
    assert state.is_completed(), state
    assert state.state_details.flow_run_id is not None
    return state.state_details.flow_run_id


def test_release_and_rollback_runs_say_what_they_did(
    fleet_config: MintConfig, worker: ManagedProcess
) -> None:
    first = run_id(release(ADAPTER, "upper", steps=4, return_state=True))
    # Any figures pass: the gate only has to run and say its verdict.
    Registry(fleet_config.tracking_uri).gates.set(ADAPTER, Gates(max_regression=1.0))
    second = run_id(release(ADAPTER, "upper", steps=4, seed=1, return_state=True))
    back = run_id(rollback(ADAPTER, actor="oncall", return_state=True))

    with get_client(sync_client=True) as client:
        runs = {run: client.read_flow_run(run) for run in (first, second, back)}
    assert [runs[run].name for run in (first, second, back)] == [
        f"release {ADAPTER}", f"release {ADAPTER}", f"rollback {ADAPTER} r2→r1"
    ]  # fmt: skip
    assert all(f"adapter:{ADAPTER}" in run.tags for run in runs.values())

    logs = run_logs(second, expect=f"{ADAPTER}@production r1 → r2")
    text = "\n".join(logs)
    assert f"INFO registered {ADAPTER}:r2" in text
    assert f"INFO {ADAPTER}:r2 evaluation passed: {ADAPTER}:r2 exact" in text
    assert f"INFO {ADAPTER}@production r1 → r2 (release)" in text
    progress = [line for line in logs if line.startswith("INFO training step ")]
    assert progress and "training step 4/4: loss " in progress[-1] and "ETA 0 s" in progress[-1]
    assert f"{ADAPTER}@production r2 → r1 (rollback)" in "\n".join(run_logs(back, expect="r2 → r1"))

    (summary,) = run_markdown(second)
    assert f"released {ADAPTER}:r2" in summary
    assert "| production | r1 → r2 |" in summary
    # Which rows the figure is on, as the CLI says it (Dataset.describe).
    assert re.search(r"\| eval_exact_match \(\d+ (held-out )?rows of [^|]+\) \| ", summary), summary
    (rolled,) = run_markdown(back)
    assert "| production | r2 → r1 |" in rolled and "| actor | oncall |" in rolled

    # The run's graph (the Prefect UI's) links each step to the steps whose results it took,
    # the datasets handed over whole (`tasks.policies.handed_whole`) included.
    assert step_inputs(second, "train") == {"data": {"load-data"}, "held_out": {"load-data"}}
    assert step_inputs(second, "register") == {
        "source": {"train"}, "frozen": {"freeze"}, "exported": {"export"},
        "held_out": {"load-data"}, "trained_on": {"load-data"},
    }  # fmt: skip


def step_inputs(run: UUID, step: str) -> dict[str, set[str]]:
    """Which steps' results `step` of flow run `run` took, by parameter, as Prefect recorded."""
    with get_client(sync_client=True) as client:
        steps = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run])))
    named = {s.id: s.name.rsplit("-", 1)[0] for s in steps}
    (taken,) = (s for s in steps if named[s.id] == step)
    return {
        parameter: {named[i.id] for i in inputs}
        for parameter, inputs in taken.task_inputs.items()
        if inputs
    }


@pytest.fixture(scope="module")
def flow_server(fleet_config: MintConfig, prefect_api: str) -> Iterator[ManagedProcess]:
    """`mint flows serve`: runs of its deployments start as its subprocesses, as a run started
    in the Prefect UI does (Prefect's engine there logs more than in a flow called in code)."""
    server = start_flow_server(fleet_config, prefect_api)
    yield server
    server.stop()


def settled_logs(run: UUID, quiet_s: float = 5.0, timeout_s: float = 90.0) -> list[str]:
    """A finished run's log once no line has come for `quiet_s` (its process sends the last
    lines in batches as it exits)."""
    lines = run_logs(run, expect="Finished in state")
    quiet_since = time.monotonic()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() - quiet_since < quiet_s and time.monotonic() < deadline:
        time.sleep(1)
        if (now := run_logs(run)) != lines:
            lines, quiet_since = now, time.monotonic()
    return lines


@pytest.mark.parametrize(
    ("deployment", "parameters", "message"),
    [
        (
            "release/release",
            {"adapter": "typo-bot", "data": "/nowhere/support.jsonl", "actor": "dana"},
            "data file /nowhere/support.jsonl does not exist",
        ),
        (
            "repair/repair",
            {"adapter": "never-released-bot", "revision": 1, "actor": "dana"},
            "adapter 'never-released-bot' is not registered",
        ),
    ],
)
def test_a_users_mistake_ends_the_run_with_one_error_line(
    flow_server: ManagedProcess, deployment: str, parameters: dict[str, object], message: str
) -> None:
    """Started as from the Prefect UI, a run that fails on a MinT error says so once: one ERROR
    line, the message, and no traceback (Prefect's own would add two of about 40 lines)."""
    run = run_deployment(deployment, parameters=parameters, timeout=300)
    assert run.state is not None and run.state.is_failed(), run.state
    assert message in (run.state.message or ""), run.state.message

    logs = settled_logs(run.id)
    errors = [line for line in logs if line.startswith("ERROR")]
    assert errors == [f"ERROR {run.state.message}"], "\n".join(logs)
    assert not any("Traceback" in line for line in logs), "\n".join(logs)


@flow(name="broken")
@ends_on_mint_error
def broken() -> None:
    raise RuntimeError("a bug in MinT")


def test_a_bug_keeps_its_traceback(prefect_api: str) -> None:
    """Not a MinT error: a bug, whose traceback is what its fixer needs."""
    state = broken(return_state=True)
    assert state.is_failed()
    assert state.state_details.flow_run_id is not None
    logs = run_logs(state.state_details.flow_run_id, expect="Traceback")
    assert any(line.startswith("ERROR") and "Traceback" in line for line in logs), logs


def test_repair_of_an_unknown_adapter_says_only_that_with_authentication(
    tmp_path: Path, prefect_api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against MLflow with its authentication, as `mint registry` runs it: MLflow answers 403,
    not 404, when asked for a version of a model that does not exist (any account); the error is
    that the adapter is not registered, with no 403 behind it."""
    accounts = RegistryAccounts.generate()
    mlflow = start_mlflow(tmp_path / "registry", accounts=accounts)
    try:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow.url)
        for name, value in accounts.pipeline.env().items():
            monkeypatch.setenv(name, value)
        state = repair("unknown-bot", 1, actor="dana", return_state=True)
    finally:
        mlflow.stop()
    error = state.result(raise_on_failure=False)
    assert isinstance(error, NotFoundError), error
    assert str(error).startswith("adapter 'unknown-bot' is not registered")
    told = "".join(traceback.format_exception(error))
    assert "403" not in told and "Permission denied" not in told, told
