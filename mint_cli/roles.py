"""`mint up --role control|train|serve|gateway`: one host's share of MinT spread over machines.

The control host runs the registry (MLflow), the Prefect server and the control pool's flow
runs, and writes `hosts/<role>.env` for the others; a host of another role is added by copying
its file there, loading it (`set -a; . ./serve.env; set +a`) and running `mint up --role serve
--host ... --advertise-url ...`. Every setting comes from the environment and the flags, and a
role is ready when it prints its `Ctrl-C stops everything` line, so scripts and tests start
roles as a person would. Plain `mint up` is every role on loopback, as before.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import subprocess
import sys
from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from control.credentials import (
    PREFECT_CLIENT_AUTH,
    SECRETS_FILE,
    ControlAddresses,
    HostSecrets,
    Role,
    host_env,
    write_host_files,
)
from mint_cli.options import PORT
from mint_core.config import GATEWAY_PORT, LOOPBACK
from mint_core.errors import ConfigurationError, ServiceError
from mint_core.exposure import Service, advertised_url, check_guarded, is_loopback, is_wildcard

if TYPE_CHECKING:
    from control.services import Supervisor
    from mint_core.config import MintConfig

S3_TEST_PORT = 9000
READY = "Ctrl-C stops everything"
"""The end of the line a role prints once all its services answer."""


def add_role_options(up: argparse.ArgumentParser) -> None:
    roles = up.add_argument_group("one host's role (MinT across machines)")
    roles.add_argument(
        "--role",
        choices=list(Role),
        default=None,
        help="start only this host's share: control (MLflow, Prefect, the control pool's "
        "worker; writes hosts/*.env), train (the train pool's worker and the trainer), serve "
        "(a worker) or gateway; default: every role on loopback",
    )
    roles.add_argument("--host", default=LOOPBACK, help="the address this role's services bind")
    roles.add_argument(
        "--advertise-url",
        default="",
        help="how other hosts reach this one: a worker's, trainer's or gateway's URL "
        "(http://name:port); for control, http://name alone (each service adds its port)",
    )
    roles.add_argument("--gateway-port", type=PORT, default=GATEWAY_PORT)
    roles.add_argument(
        "--s3-test-server",
        action="store_true",
        help="control: also run moto's S3 API (no credentials: loopback, or --test-network)",
    )
    roles.add_argument("--s3-port", type=PORT, default=S3_TEST_PORT)
    roles.add_argument(
        "--test-network",
        action="store_true",
        help="this host is on a closed test network (namespaces a test made): the S3 test "
        "server may listen beyond loopback",
    )
    roles.add_argument(
        "--no-trainer", action="store_true", help="train: only the train pool's worker"
    )


def check_up(args: argparse.Namespace, config: MintConfig) -> None:
    """Refuse what a role could not run guarded, before anything is built or started."""
    if args.role is None:
        if args.host != LOOPBACK or args.advertise_url:
            raise ConfigurationError(
                f"--host {args.host} and --advertise-url are for one host's role: plain `mint "
                "up` runs every role on loopback; add --role control|train|serve|gateway"
            )
        return
    role, host = Role(args.role), args.host
    match role:
        case Role.CONTROL:
            _control_base(args.advertise_url)  # MLflow and Prefect always run guarded
            if args.s3_test_server:
                guard = "test-network" if args.test_network else ""
                check_guarded(Service.S3_TEST, host, guard=guard)
        case Role.TRAIN:
            _prefect_api()
            if not args.no_trainer:
                check_guarded(Service.TRAINER, host, config)
                advertised_url(host, args.trainer_port, args.advertise_url)
        case Role.SERVE:
            check_guarded(Service.WORKER, host, config)
            advertised_url(host, args.worker_port, args.advertise_url or config.worker_url)
        case Role.GATEWAY:
            check_guarded(Service.GATEWAY, host, config)
            advertised_url(host, args.gateway_port, args.advertise_url)


def up_role(args: argparse.Namespace, config: MintConfig) -> None:
    """Run this host's role until Ctrl-C (`check_up` has passed)."""
    match Role(args.role):
        case Role.CONTROL:
            _up_control(args, config)
        case Role.TRAIN:
            _up_train(args, config)
        case Role.SERVE:
            _up_serve(args, config)
        case Role.GATEWAY:
            _up_gateway(args, config)


def _control_base(advertise: str) -> str:
    """The control host's advertised scheme and name (http://name), each service adding its
    port; refused with a port or path, which would be one service's."""
    parts = urlsplit(advertise)
    if advertise and (parts.scheme not in ("http", "https") or parts.port or parts.path.strip("/")):
        raise ConfigurationError(
            f"--advertise-url {advertise!r}: the control role takes http://<name> alone (MLflow, "
            "Prefect and the S3 test server each add their own port)"
        )
    return advertise.rstrip("/")


def _prefect_api() -> str:
    api = os.environ.get("PREFECT_API_URL", "")
    if not api:
        raise ConfigurationError(
            "PREFECT_API_URL is not set: a train host's worker polls the control host's Prefect "
            "server; load the train.env the control host wrote (`set -a; . ./train.env; set +a`)"
        )
    return api


@contextlib.contextmanager
def _supervised() -> Iterator[Supervisor]:
    from control.services import Supervisor

    supervisor = Supervisor(lambda line: print(line, flush=True))
    try:
        yield supervisor
    finally:
        supervisor.stop_all()
        names = [service.name for service in reversed(supervisor.services)]
        print("stopped: " + ", ".join(names), flush=True)


def _ready(supervisor: Supervisor, role: Role, config: MintConfig, lines: list[str]) -> None:
    for line in lines:
        print(line)
    print(
        f"{role} host {config.host_name}: state and logs in {config.home}; a service that exits "
        f"is started again; {READY}",
        flush=True,
    )
    supervisor.watch()


def _up_control(args: argparse.Namespace, config: MintConfig) -> None:
    from control.services import start_mlflow, start_prefect, start_prefect_worker, start_s3
    from mint_core.registry_accounts import RegistryAccounts

    base = _control_base(args.advertise_url)
    host, home = args.host, config.home
    home.mkdir(parents=True, exist_ok=True)
    secrets = HostSecrets.load_or_create(home)
    accounts = RegistryAccounts.load_or_create(home)

    def at(port: int) -> str:
        return f"{base}:{port}" if base else ""

    with _supervised() as supervisor:
        s3_url = ""
        if args.s3_test_server:
            s3 = supervisor.start(
                partial(start_s3, home, args.s3_port, host, at(args.s3_port), args.test_network),
            )
            s3_url = s3.url
            bucket = config.s3_bucket or "mint"
            config = dataclasses.replace(
                config, artifact_store="s3", s3_bucket=bucket, s3_endpoint_url=s3_url
            )
            _create_bucket(s3_url, config.s3_bucket)
        registry_db = args.backend_store_uri or config.registry_db
        mlflow, prefect = supervisor.start_together(
            partial(
                start_mlflow, home, args.mlflow_port, registry_db, accounts, store=config,
                host=host, advertise=at(args.mlflow_port),
            ),
            partial(
                start_prefect, home, args.prefect_port, host, at(args.prefect_port),
                secrets.prefect_auth,
            ),
        )  # fmt: skip
        api = prefect.url + "/api"
        config = dataclasses.replace(config, tracking_uri=mlflow.url)
        addresses = ControlAddresses(mlflow.url, api, s3_url)
        envs = {
            role: host_env(role, config, accounts, secrets, addresses, os.environ)
            for role in (Role.TRAIN, Role.SERVE, Role.GATEWAY)
        }
        written = write_host_files(home, envs)
        # The control pool's runs (promote, rollback, ...) move aliases and admit on workers:
        # the pipeline's account and key, the fleet as the registry knows it.
        runs_env = accounts.pipeline.env() | {
            "MINT_WORKER_API_KEY": secrets.worker_api_key,
            "MINT_FLEET": "registry",
        }
        os.environ |= {"PREFECT_API_URL": api, PREFECT_CLIENT_AUTH: secrets.prefect_auth}
        _deploy_flows(config, runs_env)  # the pools and their deployments, before any worker
        supervisor.start(
            partial(
                start_prefect_worker, config, config.control_pool, api, secrets.prefect_auth,
                runs_env,
            )
        )  # fmt: skip
        lines = [
            f"MLflow UI (registry):    {mlflow.url}",
            f"Prefect UI (flows):      {prefect.url}  (auth string in {home / SECRETS_FILE})",
        ]
        if s3_url:
            lines.append(f"S3 test endpoint:        {s3_url}  (bucket {config.s3_bucket})")
        pools = f"{config.control_pool} (this host), {config.train_pool} (train hosts)"
        lines.append(f"flow deployments in:    {pools}")
        for role, path in written.items():
            lines.append(f"{role} host env:{' ' * (15 - len(role))}{path}")
        _ready(supervisor, Role.CONTROL, config, lines)


def _deploy_flows(config: MintConfig, env: dict[str, str]) -> None:
    """`mint flows deploy`: the pools, each flow's deployment in its pool, the crash watch."""
    command = [sys.executable, "-m", "mint_cli", "flows", "deploy"]
    done = subprocess.run(
        command, env=os.environ | config.to_env() | env, capture_output=True, text=True
    )
    if done.returncode != 0:
        said = (done.stdout + done.stderr).strip().splitlines() or ["(it said nothing)"]
        raise ServiceError(f"`mint flows deploy` failed: {said[-1]}")


def _create_bucket(endpoint_url: str, bucket: str) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint_url)
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=bucket)


def _up_train(args: argparse.Namespace, config: MintConfig) -> None:
    from control.services import host_queue, start_prefect_worker
    from mint_cli.services import build_base
    from trainer.server import start_trainer

    api = _prefect_api()
    config = _with_train_address(config, args)
    build_base(config)  # the flow runs and the trainer load it: once, before either starts
    pool_worker = partial(
        start_prefect_worker, config, config.train_pool, api,
        os.environ.get(PREFECT_CLIENT_AUTH, ""), None, 1,
        # Its own queue besides the pool's: a run can be sent to this host.
        queues=("default", host_queue(config)),
    )  # fmt: skip
    trainer = partial(
        start_trainer, config, args.trainer_port, host=args.host, advertise=args.advertise_url
    )
    starts = [pool_worker] if args.no_trainer else [pool_worker, trainer]
    with _supervised() as supervisor:
        started = supervisor.start_together(*starts)
        lines = [f"train pool worker:       {config.host_name} in {config.train_pool} at {api}"]
        if not args.no_trainer:
            lines.append(f"Tinker API (trainer):    {started[1].url}  (TINKER_BASE_URL)")
        _ready(supervisor, Role.TRAIN, config, lines)


def _with_train_address(config: MintConfig, args: argparse.Namespace) -> MintConfig:
    """`config` with the address other train hosts reach this one at (node 0 of a training
    on several hosts listens there), from --advertise-url or --host, unless set already or
    only a wildcard is known."""
    if config.train_address:
        return config
    address = urlsplit(args.advertise_url).hostname if args.advertise_url else args.host
    if not address or is_wildcard(address) or is_loopback(address):
        return config
    return dataclasses.replace(config, train_address=address)


def _up_serve(args: argparse.Namespace, config: MintConfig) -> None:
    from mint_cli.services import build_base
    from serving.worker.server import start_worker

    if args.advertise_url:
        config = dataclasses.replace(config, worker_url=args.advertise_url.rstrip("/"))
    build_base(config)
    with _supervised() as supervisor:
        worker = supervisor.start(partial(start_worker, config, args.worker_port, host=args.host))
        _ready(supervisor, Role.SERVE, config, [f"serving API (worker):    {worker.url}"])


def _up_gateway(args: argparse.Namespace, config: MintConfig) -> None:
    from processes import start_mint

    with _supervised() as supervisor:
        gateway = supervisor.start(
            partial(
                start_mint, "gateway", "gateway", "gateway", config, args.gateway_port,
                host=args.host, advertise=args.advertise_url,
            )
        )  # fmt: skip
        _ready(supervisor, Role.GATEWAY, config, [f"gateway:                 {gateway.url}"])
