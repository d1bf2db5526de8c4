"""`mint up` keeps its services running: one that exits (the trainer, stopped to restart it) is
started again with a line saying so while the others run on, and Ctrl-C still stops them all."""

import os
import re
import signal
import subprocess
from pathlib import Path

import httpx
import psutil
import pytest

from control.services import free_port
from mint_core.model.base import BaseModel
from tests.integration.helpers import mint_env, start_mint, stop_and_check, wait_for


def child(up: subprocess.Popen[bytes], command: str) -> psutil.Process:
    """The process of `mint up`'s child `python -m mint_cli <command>` (under its shim, if any)."""
    for process in psutil.Process(up.pid).children(recursive=True):
        argv = process.cmdline()
        if "mint_cli" in argv and command in argv and "-c" not in argv:
            return process
    raise AssertionError(f"no `mint {command}` among the children of mint up")


@pytest.mark.slow
def test_mint_up_restarts_a_child_that_exits_and_ctrl_c_still_stops_all(
    base: BaseModel, started: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    home = tmp_path / "home"
    (home / "base").mkdir(parents=True)
    os.symlink(base.path, home / "base" / base.path.name)  # the session's, already pretrained
    ports = [str(free_port()) for _ in range(4)]
    log = tmp_path / "up.log"
    args = ["up", "--mlflow-port", ports[0], "--prefect-port", ports[1], "--worker-port", ports[2],
            "--trainer-port", ports[3]]  # fmt: skip
    up = start_mint(started, args, mint_env(MINT_HOME=str(home)), log)
    wait_for(lambda: "Ctrl-C stops everything" in log.read_text(), up, log, timeout_s=600)
    worker, trainer = child(up, "serve"), child(up, "trainer")
    trainer_url = f"http://127.0.0.1:{ports[3]}"

    trainer.kill()  # as a user stopping it to restart it, or a crash, would
    wait_for(lambda: "trainer started again" in log.read_text(), up, log, timeout_s=600)
    said = log.read_text()
    assert re.search(r"^trainer exited \(code -9\); starting it again in 1 s", said, re.M), said
    assert f"trainer started again at {trainer_url}" in said
    assert httpx.get(trainer_url + "/health", timeout=10).status_code == 200
    assert child(up, "trainer").pid != trainer.pid
    assert child(up, "serve").pid == worker.pid  # the others ran on
    for port in ports[:3]:
        path = "/api/health" if port == ports[1] else "/health"
        assert httpx.get(f"http://127.0.0.1:{port}{path}", timeout=10).status_code == 200

    urls = [
        f"http://127.0.0.1:{ports[0]}/health",
        f"http://127.0.0.1:{ports[1]}/api/health",
        f"http://127.0.0.1:{ports[2]}/health",
        f"{trainer_url}/health",
    ]
    stop_and_check(up, signal.SIGINT, urls, log)  # Ctrl-C
    stopped = "stopped: trainer, flow server, serving worker, prefect server, mlflow server"
    assert stopped in log.read_text()
