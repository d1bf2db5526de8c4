"""Session fixtures: a tiny base, a real `mlflow server`, a real worker process and Prefect's
local API, all on loopback, started once per session and always stopped."""

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# Prefect reads its settings when first imported, and a bare import writes to PREFECT_HOME:
# point it at a temporary folder before any test module imports it.
_SESSION_DIR = Path(tempfile.mkdtemp(prefix="mint-tests-"))
os.environ["PREFECT_HOME"] = str(_SESSION_DIR / "prefect")
os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "120"
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["DO_NOT_TRACK"] = "1"
os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
os.environ.pop("PREFECT_API_URL", None)

from mint_cli import quiet_libraries  # noqa: E402
from mint_core.base_model import BaseModel, load_base  # noqa: E402
from mint_core.config import MintConfig  # noqa: E402
from mint_core.services import ManagedProcess, start_mlflow  # noqa: E402
from serving.client import WorkerClient  # noqa: E402
from serving.server import start_worker  # noqa: E402

quiet_libraries()

API_KEYS = {"key-team-a": "team-a", "key-team-b": "team-b"}
"""The session worker's API keys (tests only; a deployment reads them from its environment)."""


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_SESSION_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def mint_home() -> Path:
    home = _SESSION_DIR / "mint"
    home.mkdir(exist_ok=True)
    return home


@pytest.fixture(scope="session")
def base(mint_home: Path) -> BaseModel:
    """The serving base, pretrained once per session (about 40 s on 2 cores)."""
    return load_base(MintConfig().base, mint_home)


@pytest.fixture(scope="session")
def mlflow_server(mint_home: Path) -> Iterator[ManagedProcess]:
    server = start_mlflow(mint_home / "registry")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def config(mint_home: Path, mlflow_server: ManagedProcess, base: BaseModel) -> MintConfig:
    return MintConfig(home=mint_home, tracking_uri=mlflow_server.url, api_keys=API_KEYS)


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[None]:
    """Prefect's local API for the session's flows, stopped at session end (Prefect's own
    exit hook would log to pytest's already-closed output)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def worker(config: MintConfig, prefect_api: None) -> Iterator[ManagedProcess]:
    """A serving worker process; the flows in this session activate against it."""
    process = start_worker(config)
    # Flows read their configuration from the environment, as at any entry point.
    os.environ["MINT_HOME"] = str(config.home)
    os.environ["MLFLOW_TRACKING_URI"] = config.tracking_uri
    os.environ["MINT_WORKER_URLS"] = process.url
    yield process
    process.stop()


@pytest.fixture(scope="session")
def fleet_config(config: MintConfig, worker: ManagedProcess) -> MintConfig:
    return MintConfig(home=config.home, tracking_uri=config.tracking_uri, worker_urls=(worker.url,))


@pytest.fixture(scope="session")
def client(worker: ManagedProcess) -> Iterator[WorkerClient]:
    worker_client = WorkerClient(worker.url)
    yield worker_client
    worker_client.close()
