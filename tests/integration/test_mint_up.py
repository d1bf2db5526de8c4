"""`mint up` starts every service and says where each is (the release deployment served among
them), keeps them running: one that exits (the trainer, stopped to restart it) is started again
with a line saying so while the others run on, and Ctrl-C stops them all. (SIGTERM, on a fresh
home that first builds the base: tests/integration/test_cli.py.)"""

import re
import signal
import subprocess
from pathlib import Path

import httpx
import psutil
import pytest

from mint_core.model.base import BaseModel
from tests.integration.helpers import start_mint_up, stop_and_check, wait_for

STOPPED_WITHIN_S = 5.0
"""How long Ctrl-C may take to stop `mint up` and everything it started, on two busy cores."""


def child(up: subprocess.Popen[bytes], command: str) -> psutil.Process:
    """The process of `mint up`'s child `python -m mint_cli <command>` (under its shim, if any)."""
    for process in psutil.Process(up.pid).children(recursive=True):
        argv = process.cmdline()
        if "mint_cli" in argv and command in argv and "-c" not in argv:
            return process
    raise AssertionError(f"no `mint {command}` among the children of mint up")


@pytest.mark.slow
def test_mint_up_starts_everything_restarts_a_child_that_exits_and_ctrl_c_stops_all(
    base: BaseModel, started: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    up = start_mint_up(base, started, tmp_path)
    mlflow_url, prefect_url, worker_url, trainer_url = (
        health.removesuffix("/api/health").removesuffix("/health") for health in up.health
    )
    said = up.log.read_text()
    for service, url in (
        ("MLflow UI (registry)", mlflow_url),
        ("Prefect UI (flows)", prefect_url),
        ("serving API (worker)", worker_url),
        ("Tinker API (trainer)", trainer_url),
    ):
        assert re.search(rf"^{re.escape(service)}: +{re.escape(url)}\b", said, re.M), said
    assert httpx.get(trainer_url + "/health", timeout=10).json()["sdk"] == ">=0.38,<0.39"
    deployment = httpx.get(f"{prefect_url}/api/deployments/name/release/release", timeout=10)
    assert deployment.status_code == 200

    worker, trainer = child(up.process, "serve"), child(up.process, "trainer")

    trainer.kill()  # as a user stopping it to restart it, or a crash, would
    wait_for(lambda: "trainer started again" in up.log.read_text(), up.process, up.log, 600)
    said = up.log.read_text()
    assert re.search(r"^trainer exited \(code -9\); starting it again in 1 s", said, re.M), said
    assert f"trainer started again at {trainer_url}" in said
    assert httpx.get(trainer_url + "/health", timeout=10).status_code == 200
    assert child(up.process, "trainer").pid != trainer.pid
    assert child(up.process, "serve").pid == worker.pid  # the others ran on
    for health in up.health[:3]:
        assert httpx.get(health, timeout=10).status_code == 200

    stopped_s = stop_and_check(up.process, signal.SIGINT, list(up.health), up.log)  # Ctrl-C
    print(f"mint up and all it started stopped {stopped_s:.2f} s after Ctrl-C")
    stopped = "stopped: trainer, flow server, serving worker, prefect server, mlflow server"
    assert stopped in up.log.read_text()
    # The flow server stops before the Prefect server it talks to, and at once: not killed
    # when its grace runs out, nor left to retry a server that is gone.
    assert stopped_s < STOPPED_WITHIN_S, up.log.read_text()[-3000:]
    flows_log = (tmp_path / "home" / "logs" / "flows.log").read_text()
    assert "Traceback" not in flows_log, flows_log[-3000:]
