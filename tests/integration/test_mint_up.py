"""`mint up` on a fresh home builds the base before starting any service, then starts every
service and says where each is (the release deployment served among them), keeps them running:
one that exits (the trainer, stopped to restart it) is started again with a line saying so while
the others run on, and Ctrl-C stops them all. (Every `mint` command takes SIGTERM as it takes
Ctrl-C, `mint_cli.main`: both are tested on `mint registry`, tests/integration/test_cli.py.)"""

import re
import signal
import subprocess
from pathlib import Path

import httpx
import psutil
import pytest

from processes import free_port
from tests.integration.helpers import mint_env, start_mint, stop_and_check, wait_for

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
def test_mint_up_builds_the_base_then_starts_all_restarts_a_child_that_exits_ctrl_c_stops_all(
    started: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    # Pretraining the embedded default takes minutes on a loaded machine: `mint up` does it
    # first, with a bar and no time limit, so no service (the worker's health timeout least of
    # all) waits on it.
    home, log = tmp_path / "home", tmp_path / "up.log"
    ports = [free_port() for _ in range(4)]
    args = ["up", "--mlflow-port", ports[0], "--prefect-port", ports[1], "--worker-port", ports[2],
            "--trainer-port", ports[3]]  # fmt: skip
    up = start_mint(started, [str(a) for a in args], mint_env(MINT_HOME=str(home)), log)
    wait_for((home / "logs" / "mlflow.log").exists, up, log, timeout_s=1800)
    assert list((home / "base").glob("mint-tiny-*/config.json")), "a service started first"
    assert f"building the default base model in {home / 'base'}" in log.read_text()
    assert "Warning" not in log.read_text()  # e.g. Prefect's, for a home it could not make
    wait_for(lambda: "Ctrl-C stops everything" in log.read_text(), up, log, timeout_s=600)

    mlflow_url, prefect_url, worker_url, trainer_url = (f"http://127.0.0.1:{p}" for p in ports)
    health = [f"{mlflow_url}/health", f"{prefect_url}/api/health", f"{worker_url}/health",
              f"{trainer_url}/health"]  # fmt: skip
    said = log.read_text()
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

    worker, trainer = child(up, "serve"), child(up, "trainer")

    trainer.kill()  # as a user stopping it to restart it, or a crash, would
    wait_for(lambda: "trainer started again" in log.read_text(), up, log, 600)
    said = log.read_text()
    assert re.search(r"^trainer exited \(code -9\); starting it again in 1 s", said, re.M), said
    assert f"trainer started again at {trainer_url}" in said
    assert httpx.get(trainer_url + "/health", timeout=10).status_code == 200
    assert child(up, "trainer").pid != trainer.pid
    assert child(up, "serve").pid == worker.pid  # the others ran on
    for url in health[:3]:
        assert httpx.get(url, timeout=10).status_code == 200

    stopped_s = stop_and_check(up, signal.SIGINT, health, log)  # Ctrl-C
    print(f"mint up and all it started stopped {stopped_s:.2f} s after Ctrl-C")
    stopped = "stopped: trainer, flow server, serving worker, prefect server, mlflow server"
    assert stopped in log.read_text()
    # The flow server stops before the Prefect server it talks to, and at once: not killed
    # when its grace runs out, nor left to retry a server that is gone.
    assert stopped_s < STOPPED_WITHIN_S, log.read_text()[-3000:]
    flows_log = (home / "logs" / "flows.log").read_text()
    assert "Traceback" not in flows_log, flows_log[-3000:]
