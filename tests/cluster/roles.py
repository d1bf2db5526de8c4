"""MinT's roles booted inside the test cluster's hosts, the way a person starts them.

    ctl      `mint up --role control` (MLflow with its accounts, on PostgreSQL; the Prefect
             server with its auth string; moto's S3 API; the control pool's worker); it
             writes hosts/<role>.env, which every other host loads
    serve-N  a relay on :8001 in front of `mint up --role serve` on :8000, advertising the
             relay's URL (every caller reaches a worker under one name, and pays the delay)
    gw       `mint up --role gateway` on :8080
    train-N  `mint up --role train --no-trainer` (the train pool's worker)
    client   nothing: scenarios run tests/cluster/load.py there

Each host has its own MINT_HOME and PREFECT_HOME, MINT_HOST=<role> and OMP_NUM_THREADS=1; a
role is up when it prints `mint_cli.roles.READY`. The base is built once by the test process
and hard-linked into each host's MINT_HOME (building it on every host would take minutes on
2 cores). PostgreSQL is the test process's (embedded, on a unix socket, which network
namespaces do not separate). The test process's own settings never change: what a test needs
(URLs, the auth string, the accounts) is in `Booted`, for explicit clients.
"""

import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from mint_core.errors import ServiceError
from processes.managed import ManagedProcess, wait_healthy
from tests.cluster.netns import Cluster, listens

CONTROL, GATEWAY, CLIENT = "ctl", "gw", "client"
SERVE = ("serve-1", "serve-2")
TRAIN = ("train-1", "train-2")
HOSTS = (CONTROL, *TRAIN, *SERVE, GATEWAY, CLIENT)
WORKER_PORT, RELAY_PORT, GATEWAY_PORT = 8000, 8001, 8080
MLFLOW_PORT, PREFECT_PORT, S3_PORT = 5000, 4200, 9000
BOOT_TIMEOUT_S = 300.0
"""Generous: on 2 busy cores a worker loads torch and the base in tens of seconds."""

FLEET_TIMEOUT_S = 60.0
"""How long the gateway may take to list every worker up once all roles are (it reads the
workers' heartbeats from the registry every second or so)."""

QUIET = {
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "PREFECT_WORKER_QUERY_SECONDS": "1",
    "PREFECT_WORKER_PREFETCH_SECONDS": "1",
    # moto's dummies (as tests/conftest.py's); the control host hands them on in its env files.
    "AWS_ACCESS_KEY_ID": "mint-tests",
    "AWS_SECRET_ACCESS_KEY": "mint-tests",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
"""Every host's settings besides its role's: one thread per process (8 hosts share 2 cores),
no telemetry, Prefect workers polling every second."""

TRAIN_ENV = {"GLOO_SOCKET_IFNAME": "eth0"}
"""What a person deploying sets on each train host for a training on several hosts: the hosts
(namespaces) share one hostname, which gloo would otherwise resolve to pick its interface."""


@dataclass(frozen=True)
class Booted:
    """What the scenarios need to reach the booted roles (from the test process: the bridge
    reaches every host) and to act as the pipeline."""

    cluster: Cluster
    tracking_uri: str
    prefect_api: str
    prefect_auth: str
    s3_endpoint: str
    gateway_url: str
    worker_urls: dict[str, str]
    """serve role -> the worker's advertised URL (through its relay): its name in placement."""
    direct_urls: dict[str, str]
    """serve role -> the worker's own URL (no relay): a client's baseline."""
    delay_files: dict[str, Path]
    """serve role -> its relay's delay file (milliseconds; write it to change the delay)."""
    host_envs: dict[str, dict[str, str]]
    """role (train, serve, gateway) -> the variables of the env file ctl wrote for it."""
    services: dict[str, ManagedProcess]
    """host -> its `mint up --role` process (kill_tree(pid) kills the host's MinT)."""
    boot_s: dict[str, float] = field(default_factory=dict)
    """host -> seconds from the start of the boot until its role was up."""

    @property
    def pipeline_env(self) -> dict[str, str]:
        """The pipeline's settings (the train hosts'): registry account, worker key, Prefect."""
        return self.host_envs["train"]


def home_of(cluster: Cluster, role: str) -> Path:
    return cluster.state_dir / role / "home"


def role_env(
    cluster: Cluster, role: str, base_home: Path, extra: Mapping[str, str]
) -> dict[str, str]:
    """A host's environment: its own MINT_HOME (the base hard-linked in) and PREFECT_HOME."""
    home = home_of(cluster, role)
    home.mkdir(parents=True, exist_ok=True)
    if (base_home / "base").is_dir() and not (home / "base").exists():
        subprocess.run(["cp", "-al", str(base_home / "base"), str(home / "base")], check=True)
    env = {"MINT_HOME": str(home), "PREFECT_HOME": str(home / "prefect"), "MINT_HOST": role}
    return {**QUIET, **env, **extra}


def boot(cluster: Cluster, base_home: Path, registry_db: str) -> Booted:
    """Start every role in its host (ctl first: the others load the env files it writes;
    then all the others at once) and return once each is up; ServiceError naming the role
    and its log otherwise. `base_home` holds the built base; `registry_db`: MLflow's
    backend store (a PostgreSQL URI)."""
    from control.credentials import SECRETS_FILE, HostSecrets, read_env_file

    start = time.monotonic()
    boot_s: dict[str, float] = {}
    services: dict[str, ManagedProcess] = {}
    ctl = cluster.host(CONTROL).address
    argv = [sys.executable, "-m", "mint_cli", "up", "--role", "control", "--host", ctl,
            "--advertise-url", f"http://{ctl}", "--s3-test-server", "--test-network",
            "--s3-port", str(S3_PORT), "--backend-store-uri", registry_db]  # fmt: skip
    services[CONTROL] = _up(cluster, CONTROL, argv, role_env(cluster, CONTROL, base_home, {}))
    boot_s[CONTROL] = time.monotonic() - start
    hosts_dir = home_of(cluster, CONTROL) / "hosts"
    envs = {
        role: read_env_file(hosts_dir / f"{role}.env") for role in ("train", "serve", "gateway")
    }
    secrets = HostSecrets.load_or_create(home_of(cluster, CONTROL))
    assert (home_of(cluster, CONTROL) / SECRETS_FILE).exists()

    delay_files: dict[str, Path] = {}
    worker_urls, direct_urls = {}, {}
    starts: dict[str, Callable[[], ManagedProcess]] = {}
    for role in SERVE:
        address = cluster.host(role).address
        delay_files[role] = cluster.state_dir / role / "delay_ms"
        delay_files[role].parent.mkdir(parents=True, exist_ok=True)
        delay_files[role].write_text("0")
        worker_urls[role] = f"http://{address}:{RELAY_PORT}"
        direct_urls[role] = f"http://{address}:{WORKER_PORT}"
        relay = [sys.executable, "-m", "tests.cluster.relay", "--listen",
                 f"{address}:{RELAY_PORT}", "--target", f"{address}:{WORKER_PORT}",
                 "--delay-file", str(delay_files[role])]  # fmt: skip
        health = partial(listens, address, RELAY_PORT)
        cluster.run(role, "relay", relay, url=worker_urls[role], health=health)
        starts[role] = _starter(
            cluster, role, serve_argv(cluster, role, worker_urls[role]),
            role_env(cluster, role, base_home, envs["serve"]),
        )  # fmt: skip
    for role in TRAIN:
        address = cluster.host(role).address
        argv = [sys.executable, "-m", "mint_cli", "up", "--role", "train", "--host", address,
                "--no-trainer"]  # fmt: skip
        starts[role] = _starter(
            cluster, role, argv, role_env(cluster, role, base_home, envs["train"] | TRAIN_ENV)
        )
    gw = cluster.host(GATEWAY).address
    argv = [sys.executable, "-m", "mint_cli", "up", "--role", "gateway", "--host", gw,
            "--gateway-port", str(GATEWAY_PORT)]  # fmt: skip
    starts[GATEWAY] = _starter(
        cluster, GATEWAY, argv, role_env(cluster, GATEWAY, base_home, envs["gateway"])
    )

    def timed(role: str) -> tuple[str, ManagedProcess, float]:
        service = starts[role]()
        return role, service, time.monotonic() - start

    with ThreadPoolExecutor(len(starts)) as pool:
        for role, service, seconds in pool.map(timed, starts):
            services[role] = service
            boot_s[role] = seconds
    gateway_url = f"http://{gw}:{GATEWAY_PORT}"
    wait_fleet(gateway_url, list(worker_urls.values()), FLEET_TIMEOUT_S)
    boot_s["all"] = time.monotonic() - start
    return Booted(
        cluster=cluster,
        tracking_uri=envs["serve"]["MLFLOW_TRACKING_URI"],
        prefect_api=envs["train"]["PREFECT_API_URL"],
        prefect_auth=secrets.prefect_auth,
        s3_endpoint=envs["serve"].get("MINT_S3_ENDPOINT_URL", ""),
        gateway_url=gateway_url,
        worker_urls=worker_urls,
        direct_urls=direct_urls,
        delay_files=delay_files,
        host_envs=envs,
        services=services,
        boot_s=boot_s,
    )


def serve_argv(cluster: Cluster, role: str, advertise: str) -> list[str]:
    """`mint up --role serve` in host `role` on WORKER_PORT, advertising `advertise` (its
    relay's URL, as booted, or its own)."""
    address = cluster.host(role).address
    return [sys.executable, "-m", "mint_cli", "up", "--role", "serve", "--host", address,
            "--worker-port", str(WORKER_PORT), "--advertise-url", advertise]  # fmt: skip


def restart_serve(booted: Booted, role: str, advertise: str) -> ManagedProcess:
    """Start serve host `role`'s `mint up` again (its last one has exited), advertising
    `advertise`; returns once it is ready and the gateway lists it up. `booted.services`
    names the new one."""
    env = role_env(booted.cluster, role, home_of(booted.cluster, role), booted.host_envs["serve"])
    argv = serve_argv(booted.cluster, role, advertise)
    name = f"mint-up-{time.strftime('%H%M%S')}"  # a log of its own: the first says it was ready
    service = _up(booted.cluster, role, argv, env, name)
    booted.services[role] = service
    wait_fleet(booted.gateway_url, [advertise], FLEET_TIMEOUT_S)
    return service


def check_stopped(booted: Booted) -> None:
    """Once the cluster is down: ctl and each train host that was not killed stopped what it
    started and said so (the hosts get SIGTERM, which `mint up` takes as Ctrl-C)."""
    expected = {CONTROL: ("prefect worker (mint-control)", "prefect server", "mlflow server")}
    expected |= {role: ("prefect worker (mint-train)",) for role in TRAIN}
    for role, names in expected.items():
        service = booted.services[role]
        if service.process.returncode == -signal.SIGKILL:
            continue  # a scenario killed the host: nothing had a chance to say anything
        said = [
            line for line in service.log_path.read_text(errors="replace").splitlines()
            if line.startswith("stopped: ")
        ]  # fmt: skip
        if not said or not all(name in said[-1] for name in names):
            raise AssertionError(f"host {role} did not say it stopped {names}: {said[-1:]}")


def wait_fleet(gateway_url: str, workers: list[str], timeout_s: float) -> None:
    """Return once the gateway's /health lists each of `workers` (advertised URLs) up;
    ServiceError with what it last said otherwise."""
    deadline, said = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(gateway_url + "/health", timeout=5) as response:
                said = response.read().decode(errors="replace")
            up = {w["url"] for w in json.loads(said)["workers"] if w["up"]}
            if up >= set(workers):
                return
        except (OSError, ValueError, KeyError) as e:
            said = repr(e)
        time.sleep(0.5)
    raise ServiceError(
        f"the gateway at {gateway_url} did not list {workers} up within {timeout_s:.0f} s; "
        f"its /health said: {said[:1500]}"
    )


def _starter(
    cluster: Cluster, role: str, argv: list[str], env: dict[str, str]
) -> Callable[[], ManagedProcess]:
    return lambda: _up(cluster, role, argv, env)


def _up(
    cluster: Cluster, role: str, argv: list[str], env: dict[str, str], name: str = "mint-up"
) -> ManagedProcess:
    """`mint up --role ...` in host `role`, once it printed that it is ready (in its log,
    <role>/<name>.log)."""
    from mint_cli.roles import READY

    service: list[ManagedProcess] = []

    def ready() -> bool:
        try:
            return READY in service[0].log_path.read_text(errors="replace")
        except (OSError, IndexError):
            return False

    # `mint up` stops what it started on SIGTERM: give it time to stop its services in turn.
    started = cluster.run(role, name, argv, env, grace_s=30.0)
    service.append(started)
    try:
        wait_healthy(started, ready, BOOT_TIMEOUT_S)
    except ServiceError as e:
        raise ServiceError(f"host {role}: {e}") from e
    return started
