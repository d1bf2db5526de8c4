"""A roll-out that finds its adapter's roll-out slot taken waits, then gives up saying so and
changes nothing: the revision keeps its stage and no failure is recorded on it."""

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest

import tasks.pipeline
from flows.promote import promote
from mint_core.config import MintConfig
from mint_core.errors import RolloutBusyError
from mint_core.registry import ALIAS_MOVE_TAG, FAILURE_TAG, Registry
from mint_core.revisions import PRODUCTION, RevisionId
from mint_core.states import Stage
from tasks.pipeline import rollout_lock
from tests.integration.helpers import register_step_by_step
from tests.integration.helpers import toy_release as release

pytestmark = pytest.mark.slow

HELD_S = 15.0
"""How long the RL test holds the slot once the run's first revision is registered."""


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

    revision = registry.revisions.get(waiting)
    assert revision.stage is Stage.REGISTERED
    assert FAILURE_TAG not in revision.tags
    assert [move["to"] for move in registry.stages.history(waiting)][-1] == "registered"


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


def test_an_rl_sync_and_a_release_of_one_adapter_move_its_aliases_in_turn(
    fleet_config: MintConfig,
) -> None:
    """Issue 33, item 3: an RL sync is a roll-out like a release's. While a release holds the
    adapter's roll-out slot, the RL run's first revision stays registered (no admit, no `rl`
    move); once it is let go, the RL syncs and a release of the same adapter running at the
    same time move its aliases one at a time: unique move numbers, in the order of their
    times, each move recorded once."""
    from flows.rl import rl

    name = "turns-bot"
    registry = Registry(fleet_config.tracking_uri)
    failures: list[BaseException] = []

    def run(flow: Callable[[], object]) -> threading.Thread:
        def body() -> None:
            try:
                flow()
            except BaseException as e:  # reported by the test, not lost in the thread
                failures.append(e)

        thread = threading.Thread(target=body)
        thread.start()
        return thread

    first = RevisionId(name, 1)
    with rollout_lock(name):
        syncing = run(lambda: rl(name, steps=3, prompts=2, group=2, sync_every=1, max_chars=3))
        deadline = time.monotonic() + 300
        while not registry.revisions.has_adapter(name) or not registry.revisions.of(name):
            assert time.monotonic() < deadline and not failures, failures
            time.sleep(0.5)
        # As long as the slot is held, the run's first revision goes no further than registered
        # (its roll-out waits for the slot): a few seconds is what admit, prewarm and the move
        # take on the tiny base when nothing holds it back.
        time.sleep(HELD_S)
        assert registry.revisions.get(first).stage is Stage.REGISTERED
        assert registry.aliases.history(name) == []
        let_go = datetime.now(UTC)
    releasing = run(lambda: release(name, "upper", steps=5))
    syncing.join(timeout=600)
    releasing.join(timeout=600)
    assert not failures, failures
    assert not syncing.is_alive() and not releasing.is_alive()

    moves = registry.aliases.history(name)
    numbers = [move.number for move in moves]
    assert numbers == list(range(1, len(moves) + 1)), moves
    times = [datetime.fromisoformat(move.at) for move in moves]
    assert times == sorted(times) and times[0] > let_go, moves
    shipped = [move for move in moves if move.alias == "rl"]
    assert [move.to_revision for move in shipped] == sorted(m.to_revision for m in shipped)
    assert len(shipped) == 4  # its start and three syncs
    assert [move.alias for move in moves].count(PRODUCTION) == 1
    # Every move is recorded once: the tags of every version together hold no number twice.
    recorded = [
        key
        for revision in registry.revisions.of(name)
        for key in registry.revisions.get(revision.id).tags
        if key.startswith(ALIAS_MOVE_TAG)
    ]
    assert len(recorded) == len(set(recorded)) == len(moves)
