"""`mint`: the command line, the outermost layer (it may import flows and serving; nothing
imports it). Environment variables are read here and at the other edges, never on import."""

import argparse
import getpass
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from mint_core.config import MintConfig
from mint_core.errors import ConfigurationError, MintError, ServiceError


def _prepare_environment(config: MintConfig) -> None:
    """Quiet, local defaults for the libraries MinT drives; explicit settings win."""
    defaults = {
        "PREFECT_HOME": str(config.home / "prefect"),
        # The ephemeral Prefect API needs more than its default 20 s on a small machine.
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TRANSFORMERS_VERBOSITY": "error",
    }
    for name, value in defaults.items():
        os.environ.setdefault(name, value)
    quiet_libraries()


def quiet_libraries() -> None:
    """Drop progress bars and deprecation chatter that the libraries print on every load."""
    import logging
    import warnings

    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")


def cmd_release(args: argparse.Namespace, config: MintConfig) -> None:
    from flows.release import release

    report = release(
        args.adapter,
        args.task,
        steps=args.steps,
        rank=args.rank,
        seed=args.seed,
        actor=args.actor,
        principals=args.principal or None,
    )
    print(f"released {report.revision} (held-out accuracy {report.eval_accuracy:.0%})")
    print(format_stage_times(report.stage_seconds))


def cmd_import(args: argparse.Namespace, config: MintConfig) -> None:
    from flows.release import import_adapter

    report = import_adapter(
        args.adapter, str(args.path), actor=args.actor, principals=args.principal or None
    )
    print(f"imported {args.path} as {report.revision}")
    print(format_stage_times(report.stage_seconds))


def cmd_promote(args: argparse.Namespace, config: MintConfig) -> None:
    from flows.promote import promote

    served = promote(args.adapter, args.revision, actor=args.actor, reason=args.reason)
    print(f"{args.adapter}@production is now {served}")


def cmd_rollback(args: argparse.Namespace, config: MintConfig) -> None:
    from flows.promote import rollback

    served = rollback(args.adapter, args.to_revision, actor=args.actor, reason=args.reason)
    print(f"{args.adapter}@production is now {served}")


def cmd_history(args: argparse.Namespace, config: MintConfig) -> None:
    from mint_core.registry import Registry

    rows = [["time", "alias", "from", "to", "actor", "reason"]]
    for move in Registry(config.tracking_uri).alias_history(args.adapter):
        before = f"r{move.from_revision}" if move.from_revision is not None else "-"
        rows.append(
            [move.at, move.alias, before, f"r{move.to_revision}", move.actor, move.reason or "-"]
        )
    print(format_table(rows))


def cmd_serve(args: argparse.Namespace, config: MintConfig) -> None:
    from serving.server import serve

    serve(config, args.host, args.port)


def cmd_registry(args: argparse.Namespace, config: MintConfig) -> None:
    from mint_core.services import start_mlflow

    server = start_mlflow(config.home, args.port)
    print(f"MLflow server and UI at {server.url} (state in {config.home}); Ctrl-C stops it")
    try:
        server.process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


def cmd_flows_serve(args: argparse.Namespace, config: MintConfig) -> None:
    from flows.deployments import serve_deployments

    if not os.environ.get("PREFECT_API_URL"):
        raise ConfigurationError(
            "PREFECT_API_URL is not set: point it at the Prefect server the deployments belong "
            "to (e.g. http://127.0.0.1:4200/api), or run `mint up`, which starts one"
        )
    serve_deployments(config)


def cmd_up(args: argparse.Namespace, config: MintConfig) -> None:
    import dataclasses

    from flows.deployments import start_flow_server
    from mint_core.services import ManagedProcess, start_mlflow, start_prefect, stop_all
    from serving.server import start_worker

    # Ctrl-C and SIGTERM stop everything, even where a parent started us with SIGINT ignored
    # (as shells do for background jobs).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    started: list[ManagedProcess] = []
    try:
        mlflow = start_mlflow(config.home, args.mlflow_port)
        started.append(mlflow)
        prefect_server = start_prefect(config.home, args.prefect_port)
        started.append(prefect_server)
        config = dataclasses.replace(config, tracking_uri=mlflow.url)
        worker = start_worker(config, args.worker_port)
        started.append(worker)
        config = dataclasses.replace(config, worker_urls=(worker.url,))
        started.append(start_flow_server(config, prefect_server.url + "/api"))
        print(f"MLflow UI (registry):    {mlflow.url}")
        print(f"Prefect UI (flows):      {prefect_server.url}")
        print(f"serving API (worker):    {worker.url}")
        print(f"state and logs in {config.home}; Ctrl-C stops everything", flush=True)
        while all(service.process.poll() is None for service in started):
            time.sleep(0.5)
        stopped = [s for s in started if s.process.poll() is not None]
        raise ServiceError(
            f"{stopped[0].name} stopped (exit {stopped[0].process.returncode}); its log "
            f"({stopped[0].log_path}) ends with:\n{stopped[0].log_tail()}"
        )
    except KeyboardInterrupt:
        pass
    finally:
        stop_all(started)
        print("stopped: " + ", ".join(service.name for service in reversed(started)), flush=True)


def cmd_status(args: argparse.Namespace, config: MintConfig) -> None:
    print(format_table(status_rows(config)))


def status_rows(config: MintConfig) -> list[list[str]]:
    """One row per revision: adapter, revision, aliases, stage, readiness on each worker."""
    from mint_core.registry import Registry
    from serving.client import WorkerClient

    registry = Registry(config.tracking_uri)
    workers = [WorkerClient(url) for url in config.worker_urls]
    rows = [["adapter", "revision", "aliases", "stage", "readiness"]]
    for adapter in registry.adapters():
        for revision in registry.revisions(adapter):
            states = []
            for worker in workers:
                try:
                    state, _ = worker.readiness(revision.id)
                    states.append(state.value)
                except MintError:
                    states.append("unreachable")
            rows.append(
                [
                    adapter,
                    f"r{revision.id.number}",
                    ",".join(revision.aliases) or "-",
                    revision.stage.value,
                    " ".join(states),
                ]
            )
    return rows


def format_table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows
    )


def format_stage_times(seconds: dict[str, float]) -> str:
    return "  ".join(f"{stage} {s:.2f}s" for stage, s in seconds.items())


def cmd_demo(args: argparse.Namespace, config: MintConfig) -> None:
    from mint_demo import run_demo

    run_demo(config, steps=args.steps)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mint",
        description="Release, serve and govern LoRA adapter revisions over one resident base.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    release = commands.add_parser(
        "release", help="train and release the next revision of an adapter"
    )
    release.add_argument("--adapter", required=True, help="adapter name, e.g. support-bot")
    release.add_argument("--task", required=True, help="synthetic task: upper, reverse or echo")
    release.add_argument("--steps", type=int, default=200, help="training steps")
    release.add_argument("--rank", type=int, default=8, help="LoRA rank")
    release.add_argument("--seed", type=int, default=0)
    release.add_argument("--actor", default=getpass.getuser(), help="who releases (recorded)")
    release.add_argument(
        "--principal", action="append", help="who may use it (repeat; default everyone)"
    )
    release.set_defaults(run=cmd_release)

    imports = commands.add_parser(
        "import", help="release a PEFT LoRA adapter trained elsewhere, after checking it fits"
    )
    imports.add_argument("path", type=Path, help="PEFT adapter folder (adapter_config.json, ...)")
    imports.add_argument("--adapter", required=True, help="adapter name to release it under")
    imports.add_argument("--actor", default=getpass.getuser(), help="who imports (recorded)")
    imports.add_argument(
        "--principal", action="append", help="who may use it (repeat; default everyone)"
    )
    imports.set_defaults(run=cmd_import)

    promote = commands.add_parser("promote", help="serve an existing revision as production")
    promote.add_argument("--adapter", required=True)
    promote.add_argument("--revision", type=int, required=True, help="N of rN")
    promote.add_argument("--actor", default=getpass.getuser())
    promote.add_argument("--reason", default="promote")
    promote.set_defaults(run=cmd_promote)

    rollback = commands.add_parser("rollback", help="return production to its previous revision")
    rollback.add_argument("--adapter", required=True)
    rollback.add_argument(
        "--to-revision", type=int, default=None, help="N of rN (default: previous)"
    )
    rollback.add_argument("--actor", default=getpass.getuser())
    rollback.add_argument("--reason", default="rollback")
    rollback.set_defaults(run=cmd_rollback)

    history = commands.add_parser("history", help="every alias move of an adapter")
    history.add_argument("adapter")
    history.set_defaults(run=cmd_history)

    serve = commands.add_parser("serve", help="run a serving worker in the foreground")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.set_defaults(run=cmd_serve)

    registry = commands.add_parser("registry", help="run the MLflow server (registry and UI)")
    registry.add_argument("--port", type=int, default=5000)
    registry.set_defaults(run=cmd_registry)

    flows = commands.add_parser("flows", help="Prefect deployments of MinT's flows")
    flow_commands = flows.add_subparsers(dest="flows_command", required=True)
    flows_serve = flow_commands.add_parser(
        "serve",
        help="serve release, promote, rollback and retrain (+ MINT_RETRAIN schedules) to the "
        "Prefect server at PREFECT_API_URL, running their flow runs until stopped",
    )
    flows_serve.set_defaults(run=cmd_flows_serve)

    up = commands.add_parser(
        "up", help="start MLflow, Prefect, the deployments and a worker; Ctrl-C stops them"
    )
    up.add_argument("--mlflow-port", type=int, default=5000)
    up.add_argument("--prefect-port", type=int, default=4200)
    up.add_argument("--worker-port", type=int, default=8000)
    up.set_defaults(run=cmd_up)

    status = commands.add_parser("status", help="every revision with aliases, stage, readiness")
    status.set_defaults(run=cmd_status)

    demo = commands.add_parser("demo", help="start everything, release two adapters, compare")
    demo.add_argument("--steps", type=int, default=200, help="training steps per adapter")
    demo.set_defaults(run=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = MintConfig.from_env()
        _prepare_environment(config)
        args.run(args, config)
    except MintError as e:
        print(f"mint {args.command}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
