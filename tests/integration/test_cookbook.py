"""tinker-cookbook 0.6.1's own training loops, unmodified and offline, against `mint trainer` on
the embedded default: `supervised.train` on the conversations file the cookbook ships and
`rl.train` (importance sampling) on its synthetic arithmetic environment, each with the base's
folder as model name and the generic `role_colon` renderer. Both run to completion from the
cookbook's own environment (`make cookbook`), and their sampler checkpoints are MinT revisions.
"""

import dataclasses
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from mint_core.artifacts.stores import open_store
from mint_core.config import MintConfig
from mint_core.model.base import BaseModel
from mint_core.registry import Registry
from processes import ManagedProcess
from trainer.checkpoints import CheckpointPath, sampler_revision
from trainer.server import start_trainer

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv-cookbook" / "bin" / "python"
SCRIPTS = Path(__file__).parent / "cookbook"
KEY, PRINCIPAL = "tml-cookbook", "cookbook"


@pytest.fixture(scope="module")
def trainer_config(config: MintConfig) -> MintConfig:
    return dataclasses.replace(config, api_keys={KEY: PRINCIPAL})


@pytest.fixture(scope="module")
def trainer(trainer_config: MintConfig) -> Iterator[ManagedProcess]:
    process = start_trainer(trainer_config)
    yield process
    process.stop()


def run_loop(script: str, trainer: ManagedProcess, base: BaseModel, out: Path) -> dict[str, object]:
    """The cookbook loop `script` drives, in the cookbook's environment; its JSON report."""
    assert PYTHON.exists(), "the cookbook's environment is missing: run `make cookbook`"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MINT_", "MLFLOW_"))}
    env |= {"TINKER_BASE_URL": trainer.url, "TINKER_API_KEY": KEY, "TINKER_TELEMETRY": "0"}
    done = subprocess.run(
        [str(PYTHON), str(SCRIPTS / script), str(base.text.path), str(out), "--steps", "3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("script", "loop"), [("sl_run.py", "supervised"), ("rl_run.py", "rl")])
def test_a_cookbook_loop_runs_unmodified_and_its_checkpoints_become_revisions(
    script: str,
    loop: str,
    trainer: ManagedProcess,
    trainer_config: MintConfig,
    base: BaseModel,
    tmp_path: Path,
) -> None:
    report = run_loop(script, trainer, base, tmp_path)
    assert report["loop"] == loop and report["steps"] == 3
    checkpoints = report["checkpoints"]
    assert isinstance(checkpoints, list) and [c["name"] for c in checkpoints] == ["000002", "final"]
    registry = Registry(trainer_config.tracking_uri)
    store = open_store(trainer_config)
    for checkpoint in checkpoints:
        revision = sampler_revision(store, CheckpointPath.parse(checkpoint["sampler_path"]))
        policy = registry.revisions.get(revision).policy
        assert policy.base_digest == base.digest and policy.principals == (PRINCIPAL,)
        assert policy.dataset.startswith("tinker session ")
    final = registry.revisions.get(
        sampler_revision(store, CheckpointPath.parse(str(report["final_sampler_path"])))
    )
    assert final.policy.training_steps == 3
