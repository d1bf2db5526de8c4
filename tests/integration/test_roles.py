"""`mint up --role`: the control host runs MLflow and a Prefect server that refuses requests
without its auth string, and writes each other role's env file (0600); a train host started
from train.env alone joins the train pool under its own name; a service told to listen beyond
loopback with its doors open exits at once, saying what to set.

Beyond loopback itself needs a network of its own (tests/cluster/); here the roles listen on
127.0.0.2, a loopback address other than the default, and `check_guarded`'s table is
tests/unit/test_exposure.py's.
"""

import base64
import contextlib
import json
import os
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from control.credentials import SECRETS_FILE, read_env_file
from mint_core.model.base import BaseModel
from processes import free_port, start_process
from tests.integration.helpers import MINT, mint_env, start_mint, stop_and_check, wait_for

HOST = "127.0.0.2"
READY = "Ctrl-C stops everything"


@pytest.mark.parametrize(
    ("command", "setting"),
    [("serve", "MINT_API_KEYS"), ("trainer", "MINT_API_KEYS"), ("gateway", "MINT_WORKER_API_KEY")],
)
def test_a_service_beyond_loopback_without_keys_exits_at_once(
    command: str, setting: str, tmp_path: Path
) -> None:
    began = time.monotonic()
    done = subprocess.run(
        [MINT, command, "--host", "0.0.0.0"],
        env=mint_env(MINT_HOME=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    took = time.monotonic() - began
    assert done.returncode == 1, done.stderr
    assert "would listen on '0.0.0.0', beyond loopback" in done.stderr
    assert setting in done.stderr
    assert not (tmp_path / "base").exists()  # refused before any base was built or loaded
    assert took < 30, took


def _auth(secret: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(secret.encode()).decode()}


def test_control_and_train_roles(
    base: BaseModel, started: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    home = tmp_path / "control"
    mlflow_port, prefect_port = free_port(HOST), free_port(HOST)
    log = tmp_path / "control.log"
    args = ["up", "--role", "control", "--host", HOST, "--mlflow-port", str(mlflow_port),
            "--prefect-port", str(prefect_port)]  # fmt: skip
    control = start_mint(started, args, mint_env(MINT_HOME=str(home), MINT_HOST="ctl"), log)
    wait_for(lambda: READY in log.read_text(), control, log, timeout_s=180)

    secrets = json.loads((home / SECRETS_FILE).read_text())
    api = f"http://{HOST}:{prefect_port}/api"
    envs = {}
    for role in ("train", "serve", "gateway"):
        path = home / "hosts" / f"{role}.env"
        assert path.stat().st_mode & 0o777 == 0o600, role
        envs[role] = read_env_file(path)
        assert envs[role]["MLFLOW_TRACKING_URI"] == f"http://{HOST}:{mlflow_port}"
        assert envs[role]["MINT_FLEET"] == "registry"
        assert envs[role]["MINT_WORKER_API_KEY"] == secrets["worker_api_key"]
    assert (home / SECRETS_FILE).stat().st_mode & 0o777 == 0o600
    # Only the train host talks to Prefect, and only it writes the registry.
    assert envs["train"]["PREFECT_API_URL"] == api
    assert envs["train"]["PREFECT_API_AUTH_STRING"] == secrets["prefect_auth"]
    assert "PREFECT_API_AUTH_STRING" not in envs["serve"] | envs["gateway"]
    accounts = json.loads((home / "mlflow-accounts.json").read_text())
    assert envs["train"]["MLFLOW_TRACKING_USERNAME"] == accounts["pipeline"]["username"]
    assert envs["serve"]["MLFLOW_TRACKING_USERNAME"] == accounts["worker"]["username"]
    assert envs["serve"]["MINT_API_KEYS"] == f"{secrets['worker_api_key']}=admin"

    # Prefect's server refuses its API without the auth string, but not its health.
    assert httpx.post(f"{api}/work_pools/filter", json={}).status_code == 401
    wrong = httpx.post(f"{api}/work_pools/filter", json={}, headers=_auth("guess"))
    assert wrong.status_code == 401
    pools = httpx.post(f"{api}/work_pools/filter", json={}, headers=_auth(secrets["prefect_auth"]))
    assert pools.status_code == 200
    assert {"mint-control", "mint-train"} <= {pool["name"] for pool in pools.json()}
    deployments = httpx.post(
        f"{api}/deployments/filter", json={}, headers=_auth(secrets["prefect_auth"])
    ).json()
    in_pools = {d["work_pool_name"] for d in deployments}
    assert in_pools == {"mint-control", "mint-train"}, in_pools
    assert httpx.get(f"{api}/health").status_code == 200

    # A train host: its env file and its own name, nothing else.
    train_home = tmp_path / "train"
    (train_home / "base").mkdir(parents=True)
    os.symlink(base.path, train_home / "base" / base.path.name)
    train_log = tmp_path / "train.log"
    train_env = mint_env(MINT_HOME=str(train_home), MINT_HOST="train-1") | envs["train"]
    train = start_mint(started, ["up", "--role", "train", "--no-trainer"], train_env, train_log)
    wait_for(lambda: READY in train_log.read_text(), train, train_log, timeout_s=180)
    workers = httpx.post(
        f"{api}/work_pools/mint-train/workers/filter",
        json={},
        headers=_auth(secrets["prefect_auth"]),
    )
    assert [w["name"] for w in workers.json()] == ["train-1"]

    stop_and_check(train, signal.SIGINT, [], train_log)
    assert "stopped: prefect worker (mint-train)" in train_log.read_text()
    stop_and_check(control, signal.SIGINT, [f"{api}/health"], log)
    stopped = "stopped: prefect worker (mint-control), prefect server, mlflow server"
    assert stopped in log.read_text()


TLS_APP = """
import sys
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from mint_core.connections import ConnectionBounds
from mint_core.exposure import TlsFiles
from serving.http.server import serve_http

app = Starlette(routes=[Route("/health", lambda request: PlainTextResponse("ok"))])
serve_http(app, "127.0.0.1", int(sys.argv[1]), ConnectionBounds(), TlsFiles(*sys.argv[2:4]))
"""


def test_serve_http_speaks_tls_with_the_certificate_it_is_given(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    port = free_port()
    url = f"https://127.0.0.1:{port}"
    trusting = ssl.create_default_context(cafile=str(cert))

    def answers() -> bool:
        with contextlib.suppress(httpx.TransportError):
            return httpx.get(f"{url}/health", verify=trusting).status_code == 200
        return False

    server = start_process(
        "TLS test service",
        [sys.executable, "-c", TLS_APP, str(port), str(cert), str(key)],
        url,
        answers,
        tmp_path / "tls.log",
        timeout_s=60,
    )
    try:
        with pytest.raises(httpx.ConnectError):  # signed by nobody the client trusts
            httpx.get(f"{url}/health")
        with pytest.raises(httpx.RemoteProtocolError):  # it speaks TLS only
            httpx.get(f"http://127.0.0.1:{port}/health")
    finally:
        server.stop()
