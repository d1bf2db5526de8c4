"""`mint up --role` and the services beyond loopback: a service told to listen beyond loopback
with its doors open exits at once, saying what to set; serve_http speaks TLS only.

The roles themselves are checked where they run as deployed, each in a host of its own: the
cluster lane boots `mint up --role control` and the other roles from the env files it writes
(tests/cluster/test_harness.py: the env files and what is in them, Prefect's and MLflow's auth,
the pools, the deployments, the train workers by name; tests/cluster/conftest.py: each stops
what it started). `check_guarded`'s table is tests/unit/test_exposure.py's.
"""

import contextlib
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from processes import free_port, start_process
from tests.integration.helpers import MINT, mint_env


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
