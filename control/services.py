"""Starting and stopping the processes MinT runs beside itself, on loopback only.

Each process gets its own process group, so stopping it also stops whatever it spawned (MLflow's
server forks a web server), and its output goes to a log file under the state dir.
"""

import contextlib
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
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

if TYPE_CHECKING:
    from mint_core.config import MintConfig


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


@dataclass
class ManagedProcess:
    """A started service: its process, base URL and log file."""

    name: str
    process: subprocess.Popen[bytes]
    url: str
    log_path: Path
    grace_s: float = 10.0
    """How long `stop` lets it shut down after SIGTERM before it kills what is left."""
    accounts: RegistryAccounts | None = None
    """For an MLflow server with authentication: who may sign in, and as what."""

    def stop(self, grace_s: float | None = None) -> None:
        """Stop the process and everything in its process group: SIGTERM, then SIGKILL to
        whatever still runs after `grace_s` (default: its own). Returns once none of them runs,
        even when the leader had already exited: MLflow's uvicorn outlives a `mlflow server`
        that is gone."""
        grace_s = self.grace_s if grace_s is None else grace_s
        group = self.process.pid
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            if not group_running(group):
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, sig)
            deadline = time.monotonic() + wait_s
            while group_running(group) and time.monotonic() < deadline:
                self.process.poll()  # reap the leader as soon as it exits
                time.sleep(0.05)
        self.process.poll()
        if group_running(group):
            raise ServiceError(
                f"{self.name} (process group {group}) still runs after SIGKILL; a process in "
                f"uninterruptible sleep waits on a device or file system: see `ps -g {group}`"
            )

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def log_excerpt(self) -> str:
        """Where its log is and how it ends, for an error message; an empty log is said to be
        empty rather than quoted."""
        tail = self.log_tail().strip()
        if not tail:
            return f"its log ({self.log_path}) is empty"
        return f"its log ({self.log_path}) ends with:\n{tail}"


def group_running(group: int) -> bool:
    """Whether a process of process group `group` runs. Zombies do not count: they have
    exited, and where PID 1 does not reap orphans (some containers) they stay in the group."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    proc = Path("/proc")
    if not proc.is_dir():
        return True  # no /proc to tell zombies apart; init reaps orphans on such systems
    for stat in proc.glob("[0-9]*/stat"):
        try:
            # After the command name in parentheses: state, parent pid, process group.
            state, _, pgrp = stat.read_text().rpartition(")")[2].split()[:3]
        except OSError:  # exited while we looked
            continue
        if int(pgrp) == group and state not in ("Z", "X"):
            return True
    return False


def stop_all(services: Sequence[ManagedProcess]) -> None:
    """Stop several services at once: each gets its grace period, in parallel, not in turn."""
    with ThreadPoolExecutor(max(1, len(services))) as pool:
        list(pool.map(ManagedProcess.stop, services))


def responds_ok(url: str) -> bool:
    """Whether `url` responds 200 right now: a health probe."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def start_process(
    name: str,
    argv: Sequence[str],
    url: str,
    health: str | Callable[[], bool],
    log_path: Path,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 120.0,
    die_with_parent: bool = False,
    grace_s: float = 10.0,
) -> ManagedProcess:
    """Start `argv` and return once it is healthy: `url + health` answers 200 (a path), or
    `health()` is true (a check); ServiceError if it exits or times out first.
    `die_with_parent`: the process gets SIGTERM when the thread that started it ends (Linux),
    so a child this process supervises never outlives it, even when it is SIGKILLed.
    `grace_s`: how long it may take to shut down when stopped (see `ManagedProcess.stop`)."""
    healthy = health if callable(health) else lambda: responds_ok(url + health)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            _term_with_parent(argv) if die_with_parent else list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    service = ManagedProcess(name, process, url, log_path, grace_s)
    try:
        _wait_healthy(service, healthy, timeout_s)
    except BaseException:
        service.stop()  # whatever it forked before failing, too
        raise
    return service


TERM_WITH_PARENT = """
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    sys.exit("its parent exited before it could start")
os.execvp(sys.argv[2], sys.argv[2:])
"""
"""Run as `python -c` before the service: asks Linux for SIGTERM when the thread that started
it ends, then execs the service (the request survives exec)."""


def _term_with_parent(argv: Sequence[str]) -> list[str]:
    """`argv` behind a small Python that gets it SIGTERM when the thread that started it
    ends, asked for in the child itself: not through Popen's `preexec_fn`, which runs Python
    between fork and exec and can deadlock a threaded program (a worker is one). Where Linux's
    prctl is not, `argv` as it is."""
    if sys.platform != "linux":
        return list(argv)
    # -I -S: the shim starts in tens of milliseconds and reads nothing from the environment.
    return [sys.executable, "-I", "-S", "-c", TERM_WITH_PARENT, str(os.getpid()), *argv]


def _wait_healthy(service: ManagedProcess, healthy: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if service.process.poll() is not None:
            raise ServiceError(
                f"{service.name} exited with code {service.process.returncode} while starting; "
                + service.log_excerpt()
            )
        if healthy():
            return
        time.sleep(0.2)
    raise ServiceError(
        f"{service.name} was not healthy at {service.url} within {timeout_s:.0f} s; "
        + service.log_excerpt()
    )


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


def start_mint(
    command: str,
    name: str,
    log: str,
    config: "MintConfig",
    port: int | None = None,
    timeout_s: float = 120.0,
    env: Mapping[str, str] | None = None,
) -> ManagedProcess:
    """`mint <command>` listening on loopback (on `port`, else a free one) in a child process
    with `config`'s environment plus `env`; returns once its `/health` answers. `name` says
    what it is in messages; it logs to logs/<log>-<port>.log under `config`'s state dir."""
    port = port or free_port()
    argv = [sys.executable, "-m", "mint_cli", command, "--host", LOOPBACK, "--port", str(port)]
    return start_process(
        name,
        argv,
        f"http://{LOOPBACK}:{port}",
        "/health",
        config.home / "logs" / f"{log}-{port}.log",
        config.to_env() | dict(env or {}),
        timeout_s,
    )


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
