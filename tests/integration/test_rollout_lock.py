"""A roll-out that finds its adapter's roll-out slot taken waits, then gives up saying so and
changes nothing: the revision keeps its stage and no failure is recorded on it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import tasks.pipeline
from flows.promote import promote
from mint_core.config import MintConfig
from mint_core.errors import RolloutBusyError
from mint_core.registry import FAILURE_TAG, Registry
from mint_core.revisions import RevisionId
from mint_core.states import Stage
from tasks.pipeline import rollout_lock
from tests.integration.helpers import register_step_by_step
from tests.integration.helpers import toy_release as release

pytestmark = pytest.mark.slow


@pytest.fixture
def flow_config(
    config: MintConfig, prefect_api: str, monkeypatch: pytest.MonkeyPatch
) -> MintConfig:
    """Flows read their configuration from the environment; they wait 2 s for the slot."""
    for name, value in config.to_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(tasks.pipeline, "ROLLOUT_TIMEOUT_S", 2.0)
    return config


@pytest.mark.parametrize("flow", ["promote", "release"])
def test_a_busy_rollout_slot_leaves_the_revision_as_it_was(
    flow_config: MintConfig, flow: str
) -> None:
    name = f"busy-slot-{flow}-bot"
    registry = Registry(flow_config.tracking_uri)
    first, _, _ = register_step_by_step(flow_config, name, "upper")
    waiting = first if flow == "promote" else RevisionId(name, first.number + 1)

    with rollout_lock(name), pytest.raises(RolloutBusyError, match=f"'{name}'.* was busy for 2 s"):
        if flow == "promote":
            promote(name, first.number)
        else:
            release(name, "upper", steps=5)

    revision = registry.get(waiting)
    assert revision.stage is Stage.REGISTERED
    assert FAILURE_TAG not in revision.tags
    assert registry.stage_history(waiting) == []


def test_taking_the_slot_again_logs_no_traceback(tmp_path: Path) -> None:
    """A roll-out takes its slot twice (fleet, then the alias move) and the CLI runs Prefect's
    temporary server in a fresh PREFECT_HOME: the second take must not make that server log
    an IntegrityError traceback for a limit that already exists (issue 23, item 9)."""
    script = (
        "from prefect import flow\n"
        "from tasks.pipeline import rollout_lock\n"
        "@flow\n"
        "def twice() -> None:\n"
        "    for _ in range(3):\n"
        "        with rollout_lock('quiet-bot'):\n"
        "            pass\n"
        "twice()\n"
        "print('done')\n"
    )
    own = ("PREFECT_", "MINT_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(own)} | {
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PYTHONPATH": str(Path(__file__).parents[2]),
    }
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "done" in done.stdout, output[-3000:]
    assert "Traceback" not in output and "IntegrityError" not in output, output[-3000:]
