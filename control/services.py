"""The services the control plane runs beside MinT: MLflow, an S3 API, Prefect, and the
`Supervisor` that keeps `mint up`'s services running. Each listens on loopback unless given a
host, and then only guarded (`mint_core.exposure.check_guarded`). Starting and stopping a
process is `processes`'s, shared with serving and the trainer.
"""

import contextlib
import json
import os
import sqlite3
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from control.credentials import PREFECT_CLIENT_AUTH, PREFECT_SERVER_AUTH
from mint_core.config import LOOPBACK
from mint_core.errors import ServiceError
from mint_core.exposure import (
    Service,
    advertised_url,
    check_guarded,
    is_loopback,
    is_wildcard,
    local_url,
    url_host,
)
from mint_core.registry_accounts import (
    ACCOUNTS_VARIABLE,
    AUTH_VARIABLE,
    PASSWORD_VARIABLE,
    USERNAME_VARIABLE,
    RegistryAccounts,
    auth_config,
)
from processes import ManagedProcess, free_port, start_process, start_together, stop_all
from processes.managed import basic_auth

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
    host: str = LOOPBACK,
    advertise: str = "",
) -> ManagedProcess:
    """An MLflow tracking server on `host` (default loopback; beyond it, only with `accounts`),
    its URL `advertise` if given (what other hosts use), one worker, artifacts under `home`;
    its backend store is `backend_store_uri` (a PostgreSQL or sqlite URI), by default sqlite
    under `home`.
    With `accounts`, MLflow's basic-auth app guards it (users in sqlite under `home`): every
    account reads, only the pipeline's writes (`mint_core.registry_accounts`); the server makes
    the accounts before it answers `/health`, so each signs in as soon as it is up. Model-version
    pages show revisions' files from the artifact store `store` configures (by default the one
    the environment's MINT_HOME and MINT_S3_* name), and it serves HTTPS with `store`'s
    MINT_TLS_CERT and MINT_TLS_KEY if it names them."""
    check_guarded(Service.MLFLOW, host, guard=accounts.admin.username if accounts else "")
    port = port or free_port(host)
    tls = store.tls if store is not None else None
    url = advertised_url(host, port, advertise, bool(tls and tls.enabled))
    home.mkdir(parents=True, exist_ok=True)
    backend_store_uri = backend_store_uri or f"sqlite:///{home.absolute() / 'mlflow.db'}"
    _write_ahead_log(backend_store_uri)
    # uvicorn otherwise waits on SIGTERM for every request in flight, however long a client
    # takes to send it (a release retrying, a slow upload): stopping would hang.
    uvicorn_opts = f"--timeout-graceful-shutdown {MLFLOW_SHUTDOWN_S:g}"
    if tls is not None and tls.enabled:
        uvicorn_opts += f" --ssl-certfile {tls.cert} --ssl-keyfile {tls.key}"
    argv = [
        sys.executable, "-m", "mlflow", "server",
        "--host", host,
        "--port", str(port),
        "--workers", "1",
        "--backend-store-uri", backend_store_uri,
        "--artifacts-destination", str(home.absolute() / "mlflow-artifacts"),
        "--uvicorn-opts", uvicorn_opts,
        # MinT's app (mint_mlflow): MLflow's, its UI opening on model training, not GenAI.
        "--app-name", "mint",
    ]  # fmt: skip
    if not is_loopback(host):
        argv += ["--allowed-hosts", ",".join(allowed_hosts(host, url))]
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
        local_url(host, port, bool(tls and tls.enabled)),
        "/health",
        home / "logs" / "mlflow.log",
        env,
        backing=True,
        # Past its own shutdown timeout, with half a second to spare, what is left is killed; its
        # database keeps only committed transactions (sqlite's journal, PostgreSQL), so a
        # request cut short leaves nothing half-written.
        grace_s=MLFLOW_SHUTDOWN_S + 0.5,
    )
    server.url = url
    server.accounts = accounts
    return server


def allowed_hosts(host: str, url: str) -> list[str]:
    """The Host headers an MLflow server on `host`, reached at `url`, answers: MLflow 3.17
    refuses any other with 403, and by default allows only loopback and private addresses,
    so a control host reached by name would refuse every other host."""
    names = ["localhost", "127.0.0.1", "[::1]"]
    if not is_wildcard(host):
        names.append(url_host(host))
    advertised = urlsplit(url).hostname
    if advertised:
        names.append(url_host(advertised))
    return [entry for name in dict.fromkeys(names) for entry in (name, f"{name}:*")]


def start_s3(
    home: Path,
    port: int | None = None,
    host: str = LOOPBACK,
    advertise: str = "",
    test_network: bool = False,
) -> ManagedProcess:
    """An S3 API (moto's server) on `host` (default loopback), for tests and local runs of the
    S3 store. It keeps objects in memory: what it holds is gone when it stops. It has no
    credentials: beyond loopback only on a closed `test_network` (namespaces a test made)."""
    check_guarded(Service.S3_TEST, host, guard="test-network" if test_network else "")
    port = port or free_port(host)
    url = advertised_url(host, port, advertise)
    argv = [sys.executable, "-m", "moto.server", "-H", host, "-p", str(port)]
    server = start_process(
        "moto S3 server",
        argv,
        local_url(host, port),
        "/moto-api/",
        home / "logs" / f"s3-{port}.log",
        backing=True,
    )
    server.url = url
    return server


def start_prefect(
    home: Path,
    port: int | None = None,
    host: str = LOOPBACK,
    advertise: str = "",
    auth: str = "",
) -> ManagedProcess:
    """A Prefect server (API and UI) on `host` (default loopback), its database under `home`.
    Its API is at `url + "/api"`, `url` being `advertise` if given (what other hosts use).
    With `auth` (beyond loopback, required), every API request but its health checks must
    carry it (PREFECT_API_AUTH_STRING on the clients' side), and its UI asks for it."""
    check_guarded(Service.PREFECT, host, guard=auth)
    port = port or free_port(host)
    url = advertised_url(host, port, advertise)
    argv = [
        sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", str(port)
    ]  # fmt: skip
    env = {
        "PREFECT_HOME": str(home.absolute() / "prefect"),
        "PREFECT_API_URL": "",
        # The UI asks its API at this address; Prefect's default is port 4200 whatever port
        # the server was started on, and the UI of any other port shows only errors.
        "PREFECT_UI_API_URL": f"{url}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
    }
    if auth:
        env[PREFECT_SERVER_AUTH] = auth
    server = start_process(
        "prefect server",
        argv,
        local_url(host, port),
        "/api/health",
        home / "logs" / "prefect.log",
        env,
        backing=True,
    )
    server.url = url
    return server


RUN_POLL_S = 0.5
"""How often the flow server and the control pool's worker ask the Prefect server for runs to
start, unless PREFECT_RUNNER_POLL_FREQUENCY / PREFECT_WORKER_QUERY_SECONDS say otherwise.
Prefect's default, 10 s, was up to 10 s of a rollback submitted in the UI spent waiting to be
noticed (issue 48); a poll is one small query (two a second: ~1% of a core for the server)."""


def start_prefect_worker(
    config: "MintConfig",
    pool: str,
    prefect_api_url: str,
    auth: str = "",
    env: Mapping[str, str] | None = None,
    limit: int | None = None,
    queues: Sequence[str] = (),
) -> ManagedProcess:
    """A worker of a process `pool` (made if missing) named after this host
    (MINT_HOST): it runs the pool's flow runs as child processes with this host's environment
    plus `env`. Returns once the server lists it among the pool's workers. `queues`: the pool's
    work queues it polls (made if missing; Prefect's worker polls no queue that does not
    exist, silently), e.g. `default` and `host_queue(config)`; none: all of the pool's."""
    name = config.host_name
    # The control pool's runs (a rollback among them) start warm under MinT's own worker
    # (`mint flows work`: 1 s rather than 6 from scheduled to running, issue 48); the train
    # pool's import torch in their runs, which a warm worker would hold in memory for good.
    worker = (
        ["mint_cli", "flows", "work"]
        if pool == config.control_pool
        else ["prefect", "worker", "start", "--type", "process"]
    )
    argv = [sys.executable, "-m", *worker, "--pool", pool, "--name", name]
    if limit is not None:
        argv += ["--limit", str(limit)]
    for queue in queues:
        argv += ["--work-queue", queue]
    worker_env = (
        config.to_env()
        | {
            "PREFECT_API_URL": prefect_api_url,
            PREFECT_CLIENT_AUTH: auth,
            # Never `uv run` a flow run: the host's environment is MinT's, installed.
            "PREFECT_RUNNER_AUTO_INSTALL_DEPENDENCIES": "false",
            # A setting given explicitly wins.
            "PREFECT_WORKER_QUERY_SECONDS": os.environ.get(
                "PREFECT_WORKER_QUERY_SECONDS", str(RUN_POLL_S)
            ),
        }
        | dict(env or {})
    )
    headers = basic_auth(auth) | {"Content-Type": "application/json"}
    filter_url = f"{prefect_api_url}/work_pools/{pool}/workers/filter"
    if queues:
        _ensure_queues(prefect_api_url, pool, queues, headers)

    def listed() -> bool:
        request = urllib.request.Request(filter_url, b"{}", headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=2) as response:
                return any(w.get("name") == name for w in json.load(response))
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
            return False

    return start_process(
        f"prefect worker ({pool})",
        argv,
        prefect_api_url,
        listed,
        config.home / "logs" / f"prefect-worker-{pool}.log",
        worker_env,
    )


def host_queue(config: "MintConfig") -> str:
    """The work queue only this host's worker polls besides its pool's default one: a run
    created in it (`run_deployment(..., work_queue_name=...)`) runs on this host."""
    return f"host-{config.host_name}"


def _ensure_queues(
    api_url: str, pool: str, queues: Sequence[str], headers: Mapping[str, str]
) -> None:
    """Create each of `queues` in `pool` (the pool first, as a process pool, as its worker
    would make it), unless it exists."""
    calls = [(f"{api_url}/work_pools/", {"name": pool, "type": "process"})]
    calls += [(f"{api_url}/work_pools/{pool}/queues", {"name": queue}) for queue in queues]
    for url, body in calls:
        request = urllib.request.Request(url, json.dumps(body).encode(), dict(headers))
        for attempt in range(QUEUE_ATTEMPTS):
            try:
                urllib.request.urlopen(request, timeout=10).close()
            except urllib.error.HTTPError as e:
                if e.code == 409:  # it exists already
                    break
                # 503: a server on SQLite whose database another host's write holds locked.
                if e.code != 503 or attempt == QUEUE_ATTEMPTS - 1:
                    raise ServiceError(f"Prefect refused to create {body} at {url}: {e}") from e
                time.sleep(1.0)
            else:
                break


QUEUE_ATTEMPTS = 5
"""How often a queue's creation is tried when Prefect answers 503 (busy), a second apart."""


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
    with a line (`say`) saying so, while the others run on. `stop_all` stops them all, those
    the others use last."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self._say = say
        self._services: list[_Supervised] = []

    def start(self, start: Callable[[], ManagedProcess]) -> ManagedProcess:
        """Start a service with `start` (which returns once it is healthy) and keep it
        running with it."""
        (service,) = self.start_together(start)
        return service

    def start_together(self, *starts: Callable[[], ManagedProcess]) -> list[ManagedProcess]:
        """Start services that wait on none of each other at once (`processes.start_together`)
        and keep them running; their services in the order of `starts`."""
        services = start_together(starts)
        now = time.monotonic()
        self._services += [
            _Supervised(start, service, now)
            for start, service in zip(starts, services, strict=True)
        ]
        return services

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
        """Stop every service, whatever its state: those the others use last (`stop_all`)."""
        stop_all(self.services)
