"""Commands that run services until stopped: `mint serve` (a worker), `gateway`, `registry`
(MLflow) and `up` (all of them, `mint flows serve` among them); and `mint demo`.

Child processes run these same commands (`python -m mint_cli serve ...`): a worker or gateway
started by `mint up`, a test or a benchmark parses the same options as one started by hand."""

from __future__ import annotations

import argparse
import dataclasses
import os
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from mint_cli.options import (
    PORT,
    address_options,
    advertise_option,
    backend_store_option,
    host_option,
    whole,
)
from mint_cli.roles import add_role_options, check_up, up_role
from mint_core.config import (
    GATEWAY_PORT,
    MLFLOW_PORT,
    PREFECT_PORT,
    TRAINER_PORT,
    WORKER_PORT,
    BackendKind,
)
from mint_core.errors import ServiceError
from mint_core.exposure import Service, advertised_url, check_guarded
from mint_core.registry_accounts import ACCOUNTS_FILE, RegistryAccounts

if TYPE_CHECKING:
    from mint_cli.options import Commands
    from mint_core.config import MintConfig


def _worker_config(args: argparse.Namespace, config: MintConfig) -> MintConfig:
    if args.backend:
        config = dataclasses.replace(config, backend=BackendKind(args.backend))
    if args.advertise_url:
        config = dataclasses.replace(config, worker_url=args.advertise_url.rstrip("/"))
    return config


def check_serve(args: argparse.Namespace, config: MintConfig) -> None:
    # Before the base loads: a worker beyond loopback with its admin doors open, or named by
    # an address no other host can use, never starts.
    config = _worker_config(args, config)
    check_guarded(Service.WORKER, args.host, config)
    advertised_url(args.host, args.port, config.worker_url, config.tls.enabled)


def cmd_serve(args: argparse.Namespace, config: MintConfig) -> None:
    from serving.worker.server import serve

    serve(_worker_config(args, config), args.host, args.port)


def check_trainer(args: argparse.Namespace, config: MintConfig) -> None:
    check_guarded(Service.TRAINER, args.host, config)


def check_gateway(args: argparse.Namespace, config: MintConfig) -> None:
    check_guarded(Service.GATEWAY, args.host, config)


def cmd_trainer(args: argparse.Namespace, config: MintConfig) -> None:
    from trainer.server import serve_trainer

    serve_trainer(config, args.host, args.port)


def cmd_gateway(args: argparse.Namespace, config: MintConfig) -> None:
    from serving.gateway import serve_gateway

    serve_gateway(config, args.host, args.port)


def cmd_registry(args: argparse.Namespace, config: MintConfig) -> None:
    from control.services import start_mlflow

    accounts = RegistryAccounts.load_or_create(config.home)
    server = start_mlflow(
        config.home,
        args.port,
        args.backend_store_uri or config.registry_db,
        accounts,
        store=config,
        host=args.host,
        advertise=args.advertise_url,
    )
    try:
        print(
            f"MLflow server and UI at {server.url} (state in {config.home}); Ctrl-C stops it",
            flush=True,
        )
        print(_accounts_line(accounts, config.home), flush=True)
        server.process.wait()
        raise ServiceError(
            f"mlflow server stopped (exit {server.process.returncode}); {server.log_excerpt()}"
        )
    finally:
        server.stop()


def cmd_up(args: argparse.Namespace, config: MintConfig) -> None:
    if args.role is not None:
        up_role(args, config)
        return
    build_base(config)  # before any service (and Prefect's import): the worker only loads it
    from control.services import Supervisor, start_mlflow, start_prefect
    from flows.deployments import start_flow_server
    from serving.worker.server import start_worker
    from trainer.server import start_trainer

    # Each service is started again, the same way, when it exits (a user stops the trainer to
    # restart it, a worker crashes): the others run on. Ctrl-C stops them all.
    supervisor = Supervisor(lambda line: print(line, flush=True))
    accounts = RegistryAccounts.load_or_create(config.home)
    registry_db = args.backend_store_uri or config.registry_db
    try:
        # Each start is bound to its arguments now: it is called again the same way.
        # Those that wait on none of each other start together: a start is mostly a Python
        # process importing its libraries, and there are two cores at least.
        mlflow, prefect_server = supervisor.start_together(
            partial(
                start_mlflow, config.home, args.mlflow_port, registry_db, accounts, store=config
            ),
            partial(start_prefect, config.home, args.prefect_port),
        )
        config = dataclasses.replace(config, tracking_uri=mlflow.url)
        os.environ.update(accounts.pipeline.env())  # the flow server's runs write
        worker = supervisor.start(
            partial(start_worker, config, args.worker_port, env=accounts.worker.env())
        )
        config = dataclasses.replace(config, worker_urls=(worker.url,))
        _, trainer = supervisor.start_together(
            partial(start_flow_server, config, prefect_server.url + "/api"),
            # The trainer registers its tenants' sampler weights: it writes as the pipeline does.
            partial(start_trainer, config, args.trainer_port, env=accounts.pipeline.env()),
        )
        print(f"MLflow UI (registry):    {mlflow.url}")
        print(f"Prefect UI (flows):      {prefect_server.url}")
        print(f"serving API (worker):    {worker.url}")
        print(f"Tinker API (trainer):    {trainer.url}  (TINKER_BASE_URL)")
        print(_accounts_line(accounts, config.home))
        print(
            f"state and logs in {config.home}; a service that exits is started again; "
            "Ctrl-C stops everything",
            flush=True,
        )
        supervisor.watch()
    finally:
        supervisor.stop_all()
        names = [service.name for service in reversed(supervisor.services)]
        print("stopped: " + ", ".join(names), flush=True)


def build_base(config: MintConfig) -> None:
    """Build the base if it is the embedded default and missing (pretrained once: seconds on
    a quiet machine, many minutes on a loaded one), with a progress bar and no time limit,
    before any service starts: a worker started on a base still to build would spend its
    health timeout pretraining it."""
    from tqdm.auto import tqdm

    from mint_core.model.base import resolve

    bar: tqdm | None = None

    def progress(step: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            print(f"building the default base model in {config.home / 'base'} (once)", flush=True)
            bar = tqdm(total=total, desc="base", unit="step", disable=None)
        bar.update(1)

    # Prefect, imported next, makes PREFECT_HOME (under MINT_HOME) but not its parents.
    config.home.mkdir(parents=True, exist_ok=True)
    try:
        resolve(config.base, config.home, progress)
    finally:
        if bar is not None:
            bar.close()


def _accounts_line(accounts: RegistryAccounts, home: Path) -> str:
    auditors = ", ".join(a.username for a in accounts.auditors)
    return (
        f"MLflow sign-in: {accounts.pipeline.username} (the pipeline: writes), {auditors} "
        f"(read only); passwords in {home / ACCOUNTS_FILE}"
    )


def cmd_demo(args: argparse.Namespace, config: MintConfig) -> None:
    from mint_demo import run_demo

    build_base(config)
    run_demo(config, steps=args.steps)


def add_commands(commands: Commands) -> None:
    serve = commands.add_parser("serve", help="run a serving worker in the foreground")
    address_options(serve, WORKER_PORT)
    serve.add_argument(
        "--backend",
        choices=list(BackendKind),
        help="what runs the model: MinT's embedded engine or a vLLM server the worker starts "
        "and supervises (default: MINT_BACKEND, else embedded)",
    )
    advertise_option(serve)
    serve.set_defaults(run=cmd_serve, check=check_serve, service=True)

    trainer = commands.add_parser(
        "trainer",
        help="run the training service in the foreground: the Tinker API (the tinker SDK and "
        "tinker-cookbook loops) over one resident base, many tenants at once",
    )
    address_options(trainer, TRAINER_PORT)
    trainer.set_defaults(run=cmd_trainer, check=check_trainer, service=True)

    gateway = commands.add_parser(
        "gateway",
        help="one front door for every worker in MINT_WORKER_URLS, whatever their bases: the "
        "workers' TGI and OpenAI APIs, each request sent to a worker of its revision's base",
    )
    address_options(gateway, GATEWAY_PORT)
    gateway.set_defaults(run=cmd_gateway, check=check_gateway, service=True)

    registry = commands.add_parser("registry", help="run the MLflow server (registry and UI)")
    host_option(registry)
    registry.add_argument("--port", type=PORT, default=MLFLOW_PORT)
    advertise_option(registry)
    backend_store_option(registry)
    registry.set_defaults(run=cmd_registry, service=True)

    up = commands.add_parser(
        "up",
        help="start MLflow, Prefect, the deployments, a worker and the trainer; Ctrl-C stops them",
    )
    up.add_argument("--mlflow-port", type=PORT, default=MLFLOW_PORT)
    up.add_argument("--prefect-port", type=PORT, default=PREFECT_PORT)
    up.add_argument("--worker-port", type=PORT, default=WORKER_PORT)
    up.add_argument("--trainer-port", type=PORT, default=TRAINER_PORT)
    backend_store_option(up)
    add_role_options(up)
    up.set_defaults(run=cmd_up, check=check_up, service=True)

    demo = commands.add_parser("demo", help="start everything, release two adapters, compare")
    demo.add_argument(
        "--steps",
        type=whole("steps"),
        default=None,
        help="training steps per adapter (default: the recipe's)",
    )
    demo.set_defaults(run=cmd_demo, loads_models=True)
