"""The services the control plane runs beside MinT, on loopback only: MLflow, an S3 API, Prefect,
and the `Supervisor` that keeps `mint up`'s services running. Starting and stopping a process is
`processes`'s, shared with serving and the trainer.
"""

import contextlib
import sqlite3
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mint_core.config import LOOPBACK
from mint_core.errors import ServiceError
from mint_core.registry_accounts import (
    ACCOUNTS_VARIABLE,
    AUTH_VARIABLE,
    PASSWORD_VARIABLE,
    USERNAME_VARIABLE,
    RegistryAccounts,
    auth_config,
)
from processes import ManagedProcess, free_port, start_process, stop_all

if TYPE_CHECKING:
    from mint_core.config import MintConfig


MLFLOW_SHUTDOWN_S = 1
"""How long the MLflow server may spend finishing requests in flight once told to stop (whole
seconds: uvicorn takes an integer)."""


def _write_ahead_log(backend_store_uri: str) -> None:
    """Put a sqlite backend store in write-ahead-log mode (kept in the file, so once is enough;
    creating the file if need be, which MLflow then fills). In sqlite's default mode every
    commit syncs the database and its rollback journal, several fsyncs per MLflow write; with
    a log, one, as durable: registering a revision took 0.6x the time. Readers (workers
    syncing) no longer wait for writers either. Any other backend is left as it is."""
    prefix = "sqlite:///"
    if not backend_store_uri.startswith(prefix):
        return
    path = Path(backend_store_uri.removeprefix(prefix))
    with contextlib.suppress(sqlite3.Error, OSError):  # MLflow reports one it cannot open
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.closing(sqlite3.connect(path)) as database:
            database.execute("PRAGMA journal_mode=WAL")


def start_mlflow(
    home: Path,
    port: int | None = None,
    backend_store_uri: str = "",
    accounts: RegistryAccounts | None = None,
    store: "MintConfig | None" = None,
) -> ManagedProcess:
    """An MLflow tracking server on loopback, one worker, artifacts under `home`; its backend
    store is `backend_store_uri` (a PostgreSQL or sqlite URI), by default sqlite under `home`.
    With `accounts`, MLflow's basic-auth app guards it (users in sqlite under `home`): every
    account reads, only the pipeline's writes (`mint_core.registry_accounts`); the server makes
    the accounts before it answers `/health`, so each signs in as soon as it is up. Model-version
    pages show revisions' files from the artifact store `store` configures (by default the one
    the environment's MINT_HOME and MINT_S3_* name)."""
    port = port or free_port()
    home.mkdir(parents=True, exist_ok=True)
    backend_store_uri = backend_store_uri or f"sqlite:///{home.absolute() / 'mlflow.db'}"
    _write_ahead_log(backend_store_uri)
    argv = [
        sys.executable, "-m", "mlflow", "server",
        "--host", LOOPBACK,
        "--port", str(port),
        "--workers", "1",
        "--backend-store-uri", backend_store_uri,
        "--artifacts-destination", str(home.absolute() / "mlflow-artifacts"),
        # uvicorn otherwise waits on SIGTERM for every request in flight, however long a
        # client takes to send it (a release retrying, a slow upload): stopping would hang.
        "--uvicorn-opts", f"--timeout-graceful-shutdown {MLFLOW_SHUTDOWN_S:g}",
        # MinT's app (mint_mlflow): MLflow's, its UI opening on model training, not GenAI.
        "--app-name", "mint",
    ]  # fmt: skip
    env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
    if store is not None:
        # mint-local:// sources resolve under the server's MINT_HOME
        # (mint_core.artifacts.mlflow_repository); MLflow reads s3:// ones itself, from the
        # endpoint it is given.
        env["MINT_HOME"] = str(store.home)
        if store.s3_endpoint_url:
            env["MLFLOW_S3_ENDPOINT_URL"] = store.s3_endpoint_url
    if accounts is not None:
        ini = home / "mlflow-auth.ini"
        ini.touch(mode=0o600)  # it holds the admin's password
        ini.write_text(auth_config(accounts, f"sqlite:///{home.absolute() / 'mlflow-auth.db'}"))
        # The server's own settings, not a client's: it must not sign in as anyone.
        env |= {
            AUTH_VARIABLE: "1",
            "MLFLOW_AUTH_CONFIG_PATH": str(ini.absolute()),
            "MLFLOW_FLASK_SERVER_SECRET_KEY": accounts.secret_key,
            ACCOUNTS_VARIABLE: accounts.to_json(),
            USERNAME_VARIABLE: "",
            PASSWORD_VARIABLE: "",
        }
    server = start_process(
        "mlflow server",
        argv,
        f"http://{LOOPBACK}:{port}",
        "/health",
        home / "logs" / "mlflow.log",
        env,
        # Past its own shutdown timeout, with half a second to spare, what is left is killed; its
        # database keeps only committed transactions (sqlite's journal, PostgreSQL), so a
        # request cut short leaves nothing half-written.
        grace_s=MLFLOW_SHUTDOWN_S + 0.5,
    )
    server.accounts = accounts
    return server


def start_s3(home: Path, port: int | None = None) -> ManagedProcess:
    """An S3 API (moto's server) on loopback, for tests and local runs of the S3 store. It keeps
    objects in memory: what it holds is gone when it stops."""
    port = port or free_port()
    argv = [sys.executable, "-m", "moto.server", "-H", LOOPBACK, "-p", str(port)]
    return start_process(
        "moto S3 server",
        argv,
        f"http://{LOOPBACK}:{port}",
        "/moto-api/",
        home / "logs" / f"s3-{port}.log",
    )


def start_prefect(home: Path, port: int | None = None) -> ManagedProcess:
    """A Prefect server (API and UI) on loopback, its database under `home`. Its API is at
    `url + "/api"`."""
    port = port or free_port()
    argv = [
        sys.executable, "-m", "prefect", "server", "start", "--host", LOOPBACK, "--port", str(port)
    ]  # fmt: skip
    env = {
        "PREFECT_HOME": str(home.absolute() / "prefect"),
        "PREFECT_API_URL": "",
        # The UI asks its API at this address; Prefect's default is port 4200 whatever port
        # the server was started on, and the UI of any other port shows only errors.
        "PREFECT_UI_API_URL": f"http://{LOOPBACK}:{port}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
    }
    return start_process(
        "prefect server",
        argv,
        f"http://{LOOPBACK}:{port}",
        "/api/health",
        home / "logs" / "prefect.log",
        env,
    )


RESTART_FIRST_S = 1.0
"""How long `Supervisor` waits before starting an exited service again; doubled at each exit
that follows soon after a start, up to `RESTART_LONGEST_S`."""
RESTART_LONGEST_S = 60.0
RESTART_STEADY_S = 60.0
"""A service that ran this long before it exited is started again after `RESTART_FIRST_S`: it
was not crashing in a loop."""


@dataclass
class _Supervised:
    start: Callable[[], ManagedProcess]
    service: ManagedProcess
    started_at: float
    """`time.monotonic()` of its last start."""
    pause_s: float = RESTART_FIRST_S
    due: float | None = None
    """While it is down: when it is to be started again."""


class Supervisor:
    """The services `mint up` runs, kept running: one that exits (stopped to restart it, or
    crashed) is started again the same way, after a pause that grows while it keeps exiting,
    with a line (`say`) saying so, while the others run on. `stop_all` stops them all."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self._say = say
        self._services: list[_Supervised] = []

    def start(self, start: Callable[[], ManagedProcess]) -> ManagedProcess:
        """Start a service with `start` (which returns once it is healthy) and keep it
        running with it."""
        service = start()
        self._services.append(_Supervised(start, service, time.monotonic()))
        return service

    @property
    def services(self) -> list[ManagedProcess]:
        """The services as they run now, in the order they were first started."""
        return [supervised.service for supervised in self._services]

    def watch(self, poll_s: float = 0.5) -> None:
        """Keep the services running until interrupted (KeyboardInterrupt)."""
        while True:
            self.check()
            time.sleep(poll_s)

    def check(self) -> None:
        """Note the services that exited and start again those whose pause is over."""
        for supervised in self._services:
            now = time.monotonic()
            service = supervised.service
            if supervised.due is None and service.process.poll() is not None:
                service.stop()  # whatever its group left behind, before one takes its port
                if now - supervised.started_at >= RESTART_STEADY_S:
                    supervised.pause_s = RESTART_FIRST_S
                supervised.due = now + supervised.pause_s
                self._say(
                    f"{service.name} exited (code {service.process.returncode}); starting it "
                    f"again in {supervised.pause_s:g} s (its log: {service.log_path})"
                )
            elif supervised.due is not None and now >= supervised.due:
                self._restart(supervised)

    def _restart(self, supervised: _Supervised) -> None:
        name = supervised.service.name
        supervised.pause_s = min(supervised.pause_s * 2, RESTART_LONGEST_S)
        try:
            supervised.service = supervised.start()
        except ServiceError as e:
            supervised.due = time.monotonic() + supervised.pause_s
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            self._say(
                f"{name} did not start again ({reason}); trying again in {supervised.pause_s:g} s"
            )
            return
        supervised.started_at = time.monotonic()
        supervised.due = None
        self._say(f"{name} started again at {supervised.service.url}")

    def stop_all(self) -> None:
        """Stop every service (in parallel), whatever its state."""
        stop_all(self.services)
