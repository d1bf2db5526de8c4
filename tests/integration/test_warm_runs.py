"""A flow run started by MinT's flow server or control pool worker is a fork of a process that
imported its flow's modules once (`flows.warm_runs`), not a fresh interpreter importing them all
again: 3 of the 4 s between a rollback's Submit and its first step (issue 48). Checked in a
fresh interpreter (the run's parent, with Prefect's own `run_flow_in_subprocess`), since warming
changes how its process starts runs, and its forkserver must end with it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prefect import flow

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PRELOADED = "email.mime.text"
"""A module nothing here imports: preloaded, a warm run finds it imported before it ran."""

STARTER = """
import json, multiprocessing.forkserver, sys
from prefect.flow_engine import run_flow_in_subprocess
from flows.warm_runs import warm_runs
from tests.integration.test_warm_runs import where_it_ran
if sys.argv[2] == "warm":
    warm_runs([{preloaded!r}])
process = run_flow_in_subprocess(where_it_ran, parameters={{"out": sys.argv[1]}})
process.join()
print(json.dumps({{"exitcode": process.exitcode,
                  "forkserver": multiprocessing.forkserver._forkserver._forkserver_pid}}))
"""


@flow
def where_it_ran(out: str) -> None:
    ran = {"parent": os.getppid(), "preloaded": PRELOADED in sys.modules}
    Path(out).write_text(json.dumps(ran))


@pytest.mark.parametrize("start", ["warm", "prefect"])
def test_a_warm_run_is_a_fork_of_the_preloaded_forkserver(
    start: str, tmp_path: Path, prefect_api: str
) -> None:
    out = tmp_path / "ran.json"
    done = subprocess.run(
        [sys.executable, "-c", STARTER.format(preloaded=PRELOADED), str(out), start],
        env=os.environ | {"PREFECT_API_URL": prefect_api},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    started = json.loads(done.stdout.strip().splitlines()[-1])
    ran = json.loads(out.read_text())
    assert started["exitcode"] == 0
    if start == "warm":
        assert ran == {"parent": started["forkserver"], "preloaded": True}
    else:  # Prefect's own: a spawned interpreter, which imports what the flow's module does
        assert ran["preloaded"] is False and started["forkserver"] is None
