"""What a flow run tells in the Prefect UI, read back through Prefect's client from the real
API: a name that says what it did, an `adapter:` tag, the key events in its log, and a summary
markdown artifact."""

import re
from uuid import UUID

import pytest
from prefect import get_client
from prefect.states import State

from control.services import ManagedProcess
from flows.promote import rollback
from mint_core.config import MintConfig
from mint_core.gates import Gates
from mint_core.registry import Registry
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
    Registry(fleet_config.tracking_uri).set_gates(ADAPTER, Gates(max_regression=1.0))
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
