"""`mint`: the command line, the outermost layer (it may import flows and serving; nothing
imports it). Environment variables are read here and at the other edges, never on import.

Every command starts quickly (this module imports no torch, transformers, MLflow or Prefect;
each command imports what it drives), checks its arguments and the services it needs before
starting anything, and fails with one line, `mint <command>: <what failed>`, its traceback
going to a log file under MINT_HOME/logs. SIGINT and SIGTERM stop whatever a command started.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import getpass
import logging
import os
import signal
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, TypeVar

from mint_core.config import BackendKind, check_registry_db
from mint_core.errors import ConfigurationError, MintError, ServiceError
from mint_core.registry_accounts import ACCOUNTS_FILE, USERNAME_VARIABLE, RegistryAccounts
from mint_core.revisions import RevisionRef, check_adapter_name
from serving.status import (
    fleet_health,
    format_stage_times,
    format_table,
    status_rows,
    worker_rows,
)

if TYPE_CHECKING:
    from mint_core.config import MintConfig

T = TypeVar("T")
TRAINING_OPTIONS = (
    "eval_fraction", "rank", "alpha", "target_modules", "expert_targets", "dropout",
    "learning_rate", "epochs", "steps", "batch_size", "gradient_accumulation", "max_length", "seed",
)  # fmt: skip
"""`mint release` options passed to the release flow as they are, when given."""
GATE_OPTIONS = (
    "eval_data", "regression_data", "max_regression", "requires_approval", "approvers",
    "self_approval", "approval_timeout_s", "canary_max_error_increase", "canary_max_p95_ratio",
    "canary_max_score_drop",
)  # fmt: skip
"""`mint gates` options: each given one changes that gate of the adapter (mint_core/gates.py)."""
REGISTRY = "registry"
WORKERS = "workers"
"""What a command needs running (`needs`), checked before it starts anything."""


def _prepare_environment(config: MintConfig, loads_models: bool) -> None:
    """Quiet, local defaults for the libraries MinT drives; explicit settings win."""
    defaults = {
        "PREFECT_HOME": str(config.home / "prefect"),
        # The ephemeral Prefect API needs more than its default 20 s on a small machine.
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        # MLflow configures its loggers on import (INFO) and prints every run's URL to stdout.
        "MLFLOW_LOGGING_LEVEL": "WARNING",
        "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TRANSFORMERS_VERBOSITY": "error",
    }
    for name, value in defaults.items():
        os.environ.setdefault(name, value)
    # The registry `mint registry`/`mint up` run from this state dir: commands act as its
    # pipeline account unless MLFLOW_TRACKING_USERNAME names another.
    accounts = RegistryAccounts.load(config.home)
    if accounts is not None and not os.environ.get(USERNAME_VARIABLE):
        os.environ.update(accounts.pipeline.env())
    if loads_models:
        quiet_libraries()


def quiet_libraries() -> None:
    """Drop progress bars and deprecation chatter that the libraries print on every load."""
    import warnings

    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")


def check_release(args: argparse.Namespace, config: MintConfig) -> None:
    """Every row of the data files, read and checked before anything starts or loads: a bad
    line is told in seconds. (The flow reads the files again: a UI run has only their names.)"""
    from mint_core.model.datasets import DEFAULT_EVAL_FRACTION, load_datasets

    def read(location: str) -> bytes:
        if not location.startswith("s3://"):
            return Path(location).read_bytes()  # a path argparse found to be a file
        from mint_core.artifact_store import read_data  # boto3 and torch: only for S3

        return read_data(config, location)

    load_datasets(
        read,
        args.data,
        args.eval_data,
        getattr(args, "eval_fraction", DEFAULT_EVAL_FRACTION),
        getattr(args, "seed", 0),
    )


def cmd_release(args: argparse.Namespace, config: MintConfig) -> None:
    from flows.release import release

    training = {name: getattr(args, name) for name in TRAINING_OPTIONS if hasattr(args, name)}
    report = release(
        args.adapter,
        args.data,
        eval_data=args.eval_data,
        actor=args.actor,
        principals=args.principal or None,
        base_model=args.base_model,
        **training,
    )
    metrics = report.eval_metrics
    print(
        f"released {report.revision} (exact match {metrics['eval_exact_match']:.0%} on "
        f"{report.eval_rows}, eval loss {metrics['eval_loss']:.4f})"
    )
    print(format_stage_times(report.stage_seconds))


def cmd_rl(args: argparse.Namespace, config: MintConfig) -> None:
    from flows.rl import rl

    options = {name: getattr(args, name) for name in RL_OPTIONS if hasattr(args, name)}
    report = rl(args.adapter, actor=args.actor, base_model=args.base_model, **options)
    figures = ", ".join(f"{name} {value:.3f}" for name, value in sorted(report.metrics.items()))
    print(f"shipped {', '.join(report.revisions)} on {args.adapter}@rl; last step: {figures}")
    print(f"MLflow run {report.run_id}")


RL_OPTIONS = ("task", "steps", "prompts", "group", "sync_every", "max_chars", "learning_rate",
              "rank", "reward", "seed", "start")  # fmt: skip


def check_import(args: argparse.Namespace, config: MintConfig) -> None:
    """DoRA, `modules_to_save`, NaN weights: refused before anything starts or loads."""
    from mint_core.model.imports import check_adapter_files

    check_adapter_files(args.path)


def cmd_import(args: argparse.Namespace, config: MintConfig) -> None:
    from flows.release import import_adapter

    report = import_adapter(
        args.adapter,
        str(args.path),
        actor=args.actor,
        principals=args.principal or None,
        base_model=args.base_model,
        same_base_as=args.same_base_as,
    )
    print(f"imported {args.path} as {report.revision}")
    print(format_stage_times(report.stage_seconds))


def cmd_promote(args: argparse.Namespace, config: MintConfig) -> None:
    from mint_core.registry import Registry
    from mint_core.revisions import RevisionId

    # Refused before Prefect starts: unknown, or already production.
    Registry(config.tracking_uri).get(RevisionId(args.adapter, args.revision)).check_promotable()
    from flows.promote import promote

    served = promote(args.adapter, args.revision, actor=args.actor, reason=args.reason)
    print(f"{args.adapter}@production is now {served}")


def cmd_rollback(args: argparse.Namespace, config: MintConfig) -> None:
    from mint_core.registry import Registry
    from mint_core.revisions import RevisionId

    # Refused before Prefect starts: nothing to roll back to, or that is production already.
    registry = Registry(config.tracking_uri)
    target = (
        RevisionId(args.adapter, args.to_revision)
        if args.to_revision is not None
        else registry.previous(args.adapter)
    )
    registry.get(target).check_promotable()
    from flows.promote import rollback

    served = rollback(args.adapter, args.to_revision, actor=args.actor, reason=args.reason)
    print(f"{args.adapter}@production is now {served}")


def cmd_repair(args: argparse.Namespace, config: MintConfig) -> None:
    from flows.repair import repair

    report = repair(args.adapter, args.revision, actor=args.actor, reason=args.reason)
    artifact = "exported again from its frozen files" if report.exported_again else "intact"
    fleet = (
        f"ready again on {report.workers} worker(s)"
        if report.workers
        else "not re-admitted, as no production or candidate alias names it"
    )
    print(f"repaired {report.revision}: artifact {artifact}; {fleet}")


def cmd_pull(args: argparse.Namespace, config: MintConfig) -> None:
    from mint_core.artifact_store import open_store
    from mint_core.pulling import pull
    from mint_core.registry import Registry

    pulled = pull(Registry(config.tracking_uri), open_store(config), args.ref, args.to, args.base)
    print(
        f"pulled {pulled.revision} into {pulled.folder} (content {pulled.content_digest}, "
        f"verified), a PEFT adapter over {pulled.base}: "
        f"AutoPeftModelForCausalLM.from_pretrained({str(pulled.folder)!r}) loads it"
    )


def cmd_history(args: argparse.Namespace, config: MintConfig) -> None:
    from mint_core.registry import Registry

    rows = [["time", "alias", "from", "to", "actor", "approver", "reason"]]
    for move in Registry(config.tracking_uri).alias_history(args.adapter):
        before = f"r{move.from_revision}" if move.from_revision is not None else "-"
        rows.append([move.at, move.alias, before, f"r{move.to_revision}", move.actor,
                     move.approver or "-", move.reason or "-"])  # fmt: skip
    print(format_table(rows))


def cmd_gates(args: argparse.Namespace, config: MintConfig) -> None:
    from mint_core.registry import Registry

    registry = Registry(config.tracking_uri)
    changes = {name: getattr(args, name) for name in GATE_OPTIONS}
    gates = registry.gates(args.adapter)
    if any(value is not None for value in changes.values()):
        gates = gates.changed(**changes)
        registry.set_gates(args.adapter, gates)
    print(format_table([["gate", "value"], *map(list, gates.rows())]))


def cmd_approve(args: argparse.Namespace, config: MintConfig) -> None:
    from flows.approval import Verdict, answer_approval
    from mint_core.revisions import RevisionId

    verdict = Verdict.REJECT if args.reject else Verdict.APPROVE
    revision = RevisionId(args.adapter, args.revision)
    run_id = answer_approval(config, revision, verdict, args.reviewer, args.comment)
    print(f"{verdict} of {revision} sent to its paused roll-out (Prefect flow run {run_id})")


def cmd_canary(args: argparse.Namespace, config: MintConfig) -> None:
    from flows.canary import canary

    report = canary(
        args.adapter,
        args.revision,
        percent=args.percent,
        window_s=args.window,
        min_requests=args.min_requests,
        actor=args.actor,
    )
    print(f"{report.revision} {report.reason}")


def cmd_serve(args: argparse.Namespace, config: MintConfig) -> None:
    from serving.server import serve

    if args.backend:
        config = dataclasses.replace(config, backend=BackendKind(args.backend))
    serve(config, args.host, args.port)


def cmd_gateway(args: argparse.Namespace, config: MintConfig) -> None:
    from serving.gateway import serve_gateway

    serve_gateway(config, args.host, args.port)


def cmd_registry(args: argparse.Namespace, config: MintConfig) -> None:
    from mint_core.services import start_mlflow

    accounts = RegistryAccounts.load_or_create(config.home)
    server = start_mlflow(
        config.home, args.port, args.backend_store_uri or config.registry_db, accounts, store=config
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


def cmd_flows_serve(args: argparse.Namespace, config: MintConfig) -> None:
    from flows.deployments import serve_deployments

    if not os.environ.get("PREFECT_API_URL"):
        raise ConfigurationError(
            "PREFECT_API_URL is not set: point it at the Prefect server the deployments belong "
            "to (e.g. http://127.0.0.1:4200/api), or run `mint up`, which starts one"
        )
    serve_deployments(config)


def cmd_up(args: argparse.Namespace, config: MintConfig) -> None:
    build_base(config)  # before any service (and Prefect's import): the worker only loads it
    from flows.deployments import start_flow_server
    from mint_core.services import ManagedProcess, start_mlflow, start_prefect, stop_all
    from serving.server import start_worker

    started: list[ManagedProcess] = []
    accounts = RegistryAccounts.load_or_create(config.home)
    try:
        mlflow = start_mlflow(
            config.home,
            args.mlflow_port,
            args.backend_store_uri or config.registry_db,
            accounts,
            store=config,
        )
        started.append(mlflow)
        prefect_server = start_prefect(config.home, args.prefect_port)
        started.append(prefect_server)
        config = dataclasses.replace(config, tracking_uri=mlflow.url)
        os.environ.update(accounts.pipeline.env())  # the flow server's runs write
        worker = start_worker(config, args.worker_port, env=accounts.worker.env())
        started.append(worker)
        config = dataclasses.replace(config, worker_urls=(worker.url,))
        started.append(start_flow_server(config, prefect_server.url + "/api"))
        print(f"MLflow UI (registry):    {mlflow.url}")
        print(f"Prefect UI (flows):      {prefect_server.url}")
        print(f"serving API (worker):    {worker.url}")
        print(_accounts_line(accounts, config.home))
        print(f"state and logs in {config.home}; Ctrl-C stops everything", flush=True)
        while all(service.process.poll() is None for service in started):
            time.sleep(0.5)
        stopped = [s for s in started if s.process.poll() is not None]
        raise ServiceError(
            f"{stopped[0].name} stopped (exit {stopped[0].process.returncode}); "
            + stopped[0].log_excerpt()
        )
    finally:
        stop_all(started)
        print("stopped: " + ", ".join(service.name for service in reversed(started)), flush=True)


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


def cmd_catalog_snapshot(args: argparse.Namespace, config: MintConfig) -> None:
    # Not through the Prefect task: that module imports torch, which this needs not.
    from mint_core.artifact_store import open_store
    from mint_core.catalog import build_snapshot
    from mint_core.registry import Registry

    snapshot = build_snapshot(
        Registry(config.tracking_uri),
        open_store(config),
        config.work_root / "catalog",
        config.catalog_snapshots,
    )
    print(f"catalog snapshot {snapshot.digest}: {snapshot.adapters} adapters, "
          f"{snapshot.revisions} revisions, {snapshot.size / 1e6:.1f} MB; workers starting "
          "now begin from it")  # fmt: skip


def cmd_status(args: argparse.Namespace, config: MintConfig) -> None:
    fleet = fleet_health(config)
    print(format_table(worker_rows(config, fleet)))
    print()
    print(format_table(status_rows(config, fleet)))


def cmd_demo(args: argparse.Namespace, config: MintConfig) -> None:
    from mint_demo import run_demo

    build_base(config)
    run_demo(config, steps=args.steps)


# Argument types: a bad value is refused by argparse, as one usage line, before anything starts.


def _checked(check: Callable[[str], T], what: str) -> Callable[[str], T]:
    """An argparse type from one of MinT's checks: its ConfigurationError (which says what is
    wrong and what to write instead) becomes argparse's error for the argument."""

    def parse(text: str) -> T:
        try:
            return check(text)
        except ConfigurationError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = what
    return parse


def _number(what: str, minimum: int = 1, maximum: int | None = None) -> Callable[[str], int]:
    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            bounds = f"from {minimum} to {maximum}" if maximum is not None else f"{minimum} or more"
            raise ConfigurationError(f"{what} {text!r} is not a whole number {bounds}")
        return value

    return _checked(check, what)


def _revision(text: str) -> int:
    number = text.removeprefix("r")
    if not (number.isascii() and number.isdigit()) or int(number) < 1:
        raise ConfigurationError(f"revision {text!r} is not valid; write N or rN, e.g. 3 or r3")
    return int(number)


def _real(
    what: str, low: float, high: float | None = None, closed_low: bool = False
) -> Callable[[str], float]:
    """An argparse type for a number above `low` (or from it, `closed_low`) and below `high`."""

    def check(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = None
        too_low = value is not None and (value < low if closed_low else value <= low)
        if value is None or too_low or (high is not None and not value < high):
            bounds = f"from {low}" if closed_low else f"above {low}"
            bounds += f" and below {high}" if high is not None else ""
            raise ConfigurationError(f"{what} {text!r} is not a number {bounds}")
        return value

    return _checked(check, what)


def _data(text: str) -> str:
    if text.startswith("s3://"):
        return text
    path = Path(text).expanduser()
    if not path.is_file():
        problem = "is a folder" if path.is_dir() else "does not exist"
        raise ConfigurationError(
            f"data file {text!r} {problem}; give a JSONL file (a path or an s3:// URI)"
        )
    return str(path.absolute())


def _folder(text: str) -> Path:
    path = Path(text)
    if not path.is_dir():
        problem = "is not a folder" if path.exists() else "does not exist"
        raise ConfigurationError(
            f"{text!r} {problem}; give the folder of a PEFT adapter (adapter_config.json and "
            "its weights)"
        )
    return path


def _principal(text: str) -> str:
    # Principals are what API keys name (MINT_API_KEYS='key=principal,...'), so the same
    # characters are refused here; `*` is everyone.
    if not text or text != text.strip() or any(c in text for c in ",= \t"):
        raise ConfigurationError(
            f"principal {text!r} is not valid; a principal is a name with no spaces, ',' or '=' "
            "(as in MINT_API_KEYS), or '*' for everyone"
        )
    return text


ADAPTER = _checked(check_adapter_name, "adapter")
DATA = _checked(_data, "data file")
FOLDER = _checked(_folder, "folder")
PRINCIPAL = _checked(_principal, "principal")
REVISION = _checked(_revision, "revision")
REF = _checked(RevisionRef.parse, "adapter reference")
BASE_MODEL_HELP = (
    "the base to train on or check against (a model folder or hub id; default MINT_BASE_MODEL): "
    "the workers serving it take the revision"
)
PORT = _number("port", 1, 65535)
REGISTRY_DB = _checked(check_registry_db, "backend store URI")


def _backend_store_option(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--backend-store-uri",
        type=REGISTRY_DB,
        help="MLflow's database: postgresql://user:password@host:port/database or "
        "sqlite:///path (default: MINT_REGISTRY_DB, else sqlite under MINT_HOME)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mint",
        description="Release, serve and govern LoRA adapter revisions over one resident base.",
    )
    # What each command needs running, whether it is a service that runs until stopped (its
    # own logs go to the terminal), and whether it loads models in this process.
    # `check` refuses bad inputs that need no service, before anything is loaded or started.
    parser.set_defaults(needs=(), service=False, loads_models=False, check=None)
    commands = parser.add_subparsers(dest="command", required=True)

    release = commands.add_parser(
        "release", help="train and release the next revision of an adapter"
    )
    release.add_argument(
        "--adapter", type=ADAPTER, required=True, help="adapter name, e.g. support-bot"
    )
    release.add_argument(
        "--data",
        type=DATA,
        required=True,
        help="training rows: a JSONL file (path or s3:// URI) of {prompt, completion} or "
        "{messages} rows",
    )
    release.add_argument(
        "--eval-data", type=DATA, default=None, help="held-out rows (default: --eval-fraction)"
    )
    # Hyperparameters left out take the release flow's defaults (TrainingConfig's), so they
    # are defined once; only those given are passed on.
    hyper = release.add_argument_group("training (defaults: the release flow's)")
    unset = argparse.SUPPRESS
    hyper.add_argument(
        "--eval-fraction",
        type=_real("eval fraction", 0, 1),
        default=unset,
        help="share of --data held out when --eval-data is not given",
    )
    hyper.add_argument("--rank", type=_number("rank"), default=unset, help="LoRA rank")
    hyper.add_argument("--alpha", type=_number("alpha"), default=unset, help="LoRA alpha")
    hyper.add_argument(
        "--target-modules",
        nargs="+",
        default=unset,
        help="module names to adapt (default: the base family's attention and MLP projections)",
    )
    hyper.add_argument(
        "--expert-targets",
        nargs="*",
        default=unset,
        help="fused MoE expert parameters to adapt, e.g. mlp.experts.down_proj (default: an MoE "
        "family's gate_up_proj and down_proj; none given: no expert LoRA)",
    )
    hyper.add_argument("--dropout", type=_real("dropout", 0, 1, closed_low=True), default=unset)
    hyper.add_argument("--learning-rate", type=_real("learning rate", 0), default=unset)
    hyper.add_argument("--epochs", type=_real("epochs", 0), default=unset)
    hyper.add_argument(
        "--steps", type=_number("steps"), default=unset, help="optimizer steps (overrides --epochs)"
    )
    hyper.add_argument("--batch-size", type=_number("batch size"), default=unset)
    hyper.add_argument(
        "--gradient-accumulation", type=_number("gradient accumulation"), default=unset
    )
    hyper.add_argument(
        "--max-length",
        type=_number("max length"),
        default=unset,
        help="longest row in tokens (default: the base's context); longer rows are refused",
    )
    hyper.add_argument("--seed", type=_number("seed", minimum=0), default=unset)
    release.add_argument("--actor", default=getpass.getuser(), help="who releases (recorded)")
    release.add_argument(
        "--principal",
        type=PRINCIPAL,
        action="append",
        help="who may use it (repeat; default everyone)",
    )
    release.add_argument("--base-model", default=None, help=BASE_MODEL_HELP)
    release.set_defaults(
        run=cmd_release, check=check_release, needs=(REGISTRY, WORKERS), loads_models=True
    )

    rl = commands.add_parser(
        "rl", help="GRPO on a toy task, sampling from the worker serving ADAPTER@rl"
    )
    rl.add_argument("--adapter", type=ADAPTER, required=True, help="adapter name, e.g. rl-bot")
    grpo = rl.add_argument_group("GRPO (defaults: the rl flow's)")
    grpo.add_argument("--task", default=unset, help="toy task: upper or reverse")
    for option in ("steps", "prompts", "group", "sync-every", "max-chars", "rank"):
        grpo.add_argument(f"--{option}", type=_number(option.replace("-", " ")), default=unset)
    grpo.add_argument("--learning-rate", type=_real("learning rate", 0), default=unset)
    grpo.add_argument("--reward", default=unset, help="exact or chars (share of right characters)")
    grpo.add_argument("--seed", type=_number("seed", minimum=0), default=unset)
    grpo.add_argument(
        "--start", default=unset, help="start from this revision: ADAPTER:rN or ADAPTER@alias"
    )
    rl.add_argument("--actor", default=getpass.getuser(), help="who runs it (recorded)")
    rl.add_argument("--base-model", default=None, help=BASE_MODEL_HELP)
    rl.set_defaults(run=cmd_rl, needs=(REGISTRY, WORKERS), loads_models=True)

    imports = commands.add_parser(
        "import", help="release a PEFT LoRA adapter trained elsewhere, after checking it fits"
    )
    imports.add_argument("path", type=FOLDER, help="PEFT adapter folder (adapter_config.json, ...)")
    imports.add_argument(
        "--adapter", type=ADAPTER, required=True, help="adapter name to release it under"
    )
    imports.add_argument("--actor", default=getpass.getuser(), help="who imports (recorded)")
    imports.add_argument(
        "--principal",
        type=PRINCIPAL,
        action="append",
        help="who may use it (repeat; default everyone)",
    )
    imports.add_argument("--base-model", default=None, help=BASE_MODEL_HELP)
    imports.add_argument(
        "--same-base-as",
        metavar="NAME",
        default="",
        help="the base the adapter records (NAME, as its base_model_name_or_path says) is a "
        "renamed copy of the base it is imported on: accept it (a different model family is "
        "refused all the same)",
    )
    imports.set_defaults(
        run=cmd_import, check=check_import, needs=(REGISTRY, WORKERS), loads_models=True
    )

    promote = commands.add_parser("promote", help="serve an existing revision as production")
    promote.add_argument("--adapter", type=ADAPTER, required=True)
    promote.add_argument("--revision", type=REVISION, required=True, help="N or rN")
    promote.add_argument("--actor", default=getpass.getuser())
    promote.add_argument("--reason", default="promote")
    promote.set_defaults(run=cmd_promote, needs=(REGISTRY, WORKERS))

    rollback = commands.add_parser("rollback", help="return production to its previous revision")
    rollback.add_argument("--adapter", type=ADAPTER, required=True)
    rollback.add_argument(
        "--to-revision", type=REVISION, default=None, help="N of rN (default: previous)"
    )
    rollback.add_argument("--actor", default=getpass.getuser())
    rollback.add_argument("--reason", default="rollback")
    rollback.set_defaults(run=cmd_rollback, needs=(REGISTRY, WORKERS))

    repair = commands.add_parser(
        "repair",
        help="export a revision again from its frozen files if its artifact is missing or "
        "damaged, and have every worker take it in again (no alias moves)",
    )
    repair.add_argument("--adapter", type=ADAPTER, required=True)
    repair.add_argument("--revision", type=REVISION, required=True, help="N or rN")
    repair.add_argument("--actor", default=getpass.getuser())
    repair.add_argument("--reason", default="repair")
    repair.set_defaults(run=cmd_repair, needs=(REGISTRY, WORKERS))

    pull = commands.add_parser(
        "pull",
        help="write a revision's files, verified, from the artifact store into a PEFT adapter "
        "folder that tools outside MinT load",
    )
    pull.add_argument("ref", type=REF, help="ADAPTER:rN or ADAPTER@alias (ADAPTER: production)")
    pull.add_argument("--to", type=Path, required=True, help="a new (or empty) folder")
    pull.add_argument(
        "--base",
        default=None,
        help="the base (hub id or folder) to record in its adapter_config.json instead of the "
        "one it was trained on",
    )
    pull.set_defaults(run=cmd_pull, needs=(REGISTRY,))

    history = commands.add_parser("history", help="every alias move of an adapter")
    history.add_argument("adapter", type=ADAPTER)
    history.set_defaults(run=cmd_history, needs=(REGISTRY,))

    gates = commands.add_parser(
        "gates",
        help="show an adapter's gates (evaluation, approval, canary margins); options change them",
    )
    gates.add_argument("adapter", type=ADAPTER)
    gates.add_argument("--eval-data", type=DATA, help="rows both revisions are scored on")
    gates.add_argument("--regression-data", type=DATA, help="further rows gated the same way")
    gates.add_argument(
        "--max-regression",
        type=_real("max regression", 0, 1, closed_low=True),
        help="how far the candidate's exact match may fall below production's",
    )
    flag = argparse.BooleanOptionalAction
    gates.add_argument("--requires-approval", action=flag, help="pause roll-outs for approval")
    gates.add_argument(
        "--approver",
        dest="approvers",
        type=PRINCIPAL,
        action="append",
        help="who may approve (repeat; replaces the list)",
    )
    gates.add_argument("--self-approval", action=flag, help="the releaser may approve")
    gates.add_argument(
        "--approval-timeout",
        dest="approval_timeout_s",
        type=_number("approval timeout"),
        help="seconds to wait for an answer before rejecting",
    )
    gates.add_argument(
        "--canary-max-error-increase", type=_real("error increase", 0, 1, closed_low=True)
    )
    gates.add_argument("--canary-max-p95-ratio", type=_real("p95 ratio", 1, closed_low=True))
    gates.add_argument("--canary-max-score-drop", type=_real("score drop", 0, 1, closed_low=True))
    gates.set_defaults(run=cmd_gates, needs=(REGISTRY,))

    approve = commands.add_parser(
        "approve", help="answer a roll-out paused for approval (as the Prefect UI's form does)"
    )
    approve.add_argument("adapter", type=ADAPTER)
    approve.add_argument("--revision", type=REVISION, required=True, help="N or rN")
    approve.add_argument("--reject", action="store_true", help="reject instead of approving")
    approve.add_argument("--comment", default="", help="recorded with the decision")
    approve.add_argument(
        "--reviewer", type=PRINCIPAL, default=getpass.getuser(), help="who answers (recorded)"
    )
    approve.set_defaults(run=cmd_approve, needs=(REGISTRY,))

    canary = commands.add_parser(
        "canary",
        help="send a share of production's requests to a revision for a window, then promote it "
        "or roll it back on the figures (the adapter's canary margins: mint gates)",
    )
    canary.add_argument("adapter", type=ADAPTER)
    canary.add_argument("--revision", type=REVISION, required=True, help="N or rN")
    canary.add_argument(
        "--percent",
        type=_real("percent", 0),
        default=10.0,
        help="share of production's requests it gets, above 0 and at most 100 (default 10)",
    )
    canary.add_argument(
        "--window", type=_real("window", 0), default=300.0, help="seconds to watch (default 300)"
    )
    canary.add_argument(
        "--min-requests",
        type=_number("min requests"),
        default=50,
        help="requests it must serve to be judged; the window grows up to 3x to get them",
    )
    canary.add_argument("--actor", default=getpass.getuser())
    canary.set_defaults(run=cmd_canary, needs=(REGISTRY, WORKERS))

    serve = commands.add_parser("serve", help="run a serving worker in the foreground")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=PORT, default=8000)
    serve.add_argument(
        "--backend",
        choices=list(BackendKind),
        help="what runs the model: MinT's embedded engine or a vLLM server the worker starts "
        "and supervises (default: MINT_BACKEND, else embedded)",
    )
    serve.set_defaults(run=cmd_serve, service=True)

    gateway = commands.add_parser(
        "gateway",
        help="one front door for every worker in MINT_WORKER_URLS, whatever their bases: the "
        "workers' TGI and OpenAI APIs, each request sent to a worker of its revision's base",
    )
    gateway.add_argument("--host", default="127.0.0.1")
    gateway.add_argument("--port", type=PORT, default=8080)
    gateway.set_defaults(run=cmd_gateway, service=True)

    registry = commands.add_parser("registry", help="run the MLflow server (registry and UI)")
    registry.add_argument("--port", type=PORT, default=5000)
    _backend_store_option(registry)
    registry.set_defaults(run=cmd_registry, service=True)

    flows = commands.add_parser("flows", help="Prefect deployments of MinT's flows")
    flow_commands = flows.add_subparsers(dest="flows_command", required=True)
    flows_serve = flow_commands.add_parser(
        "serve",
        help="serve release, promote, rollback and retrain (+ MINT_RETRAIN schedules) to the "
        "Prefect server at PREFECT_API_URL, running their flow runs until stopped",
    )
    flows_serve.set_defaults(run=cmd_flows_serve, service=True)

    up = commands.add_parser(
        "up", help="start MLflow, Prefect, the deployments and a worker; Ctrl-C stops them"
    )
    up.add_argument("--mlflow-port", type=PORT, default=5000)
    up.add_argument("--prefect-port", type=PORT, default=4200)
    up.add_argument("--worker-port", type=PORT, default=8000)
    _backend_store_option(up)
    up.set_defaults(run=cmd_up, service=True)

    catalog = commands.add_parser("catalog", help="the catalog workers start from")
    catalog_commands = catalog.add_subparsers(dest="catalog_command", required=True)
    snapshot = catalog_commands.add_parser(
        "snapshot",
        help="read the whole registry into a catalog index and publish it in the artifact store",
    )
    snapshot.set_defaults(run=cmd_catalog_snapshot, needs=(REGISTRY,))

    status = commands.add_parser("status", help="every revision with aliases, stage, readiness")
    status.set_defaults(run=cmd_status, needs=(REGISTRY,))

    demo = commands.add_parser("demo", help="start everything, release two adapters, compare")
    demo.add_argument(
        "--steps",
        type=_number("steps"),
        default=None,
        help="training steps per adapter (default: the recipe's)",
    )
    demo.set_defaults(run=cmd_demo, loads_models=True)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    subcommand = getattr(args, f"{args.command}_command", None)  # `mint flows serve`
    command = args.command + (f" {subcommand}" if subcommand else "")
    log_path: Path | None = None
    with _signals_stop_the_command():
        try:
            from mint_core.config import MintConfig

            config = MintConfig.from_env()
            log_path = config.home / "logs" / f"mint-{command.replace(' ', '-')}.log"
            if args.check is not None:
                args.check(args, config)
            _prepare_environment(config, args.loads_models)
            # A service's own logs belong on its terminal; a command's go to its log file.
            logs = contextlib.nullcontext() if args.service else _logging_to(log_path)
            with logs:
                _check_reachable(config, args.needs)
                args.run(args, config)
        except KeyboardInterrupt:
            if args.service:
                return 0  # stopping is how a service ends; what it started is stopped
            print(f"mint {command}: interrupted", file=sys.stderr)
            return 130
        except Exception as e:
            print(_failure_line(command, e, log_path), file=sys.stderr)
            return 1
    return 0


@contextlib.contextmanager
def _signals_stop_the_command() -> Iterator[None]:
    """SIGINT and SIGTERM both raise KeyboardInterrupt, so a command's cleanup (its `finally`)
    stops whatever it started, however it is stopped, even where a parent started `mint` with
    SIGINT ignored (as shells do for background jobs). Once one arrives, more are ignored: a
    second Ctrl-C must not cut that cleanup short. (uvicorn, under `mint serve`, and Prefect's
    runner, under `mint flows serve`, take SIGTERM over while they run and shut down cleanly.)"""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers; its caller's handlers stay
        return

    def stop(signum: int, frame: FrameType | None) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _logging_to(path: Path) -> Iterator[None]:
    """Log records and warnings go to `path` rather than the terminal, Prefect's flow and task
    run logs included: added before Prefect is imported, a handler on the root logger keeps
    Prefect from putting its console handler there. Flow-run logs still reach the Prefect API
    (its UI); the terminal gets the command's own output and, on failure, one line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    logging.captureWarnings(True)
    try:
        yield
    finally:
        logging.captureWarnings(False)
        root.removeHandler(handler)
        handler.close()


def _check_reachable(config: MintConfig, needs: Sequence[str]) -> None:
    """Refuse at once when a service the command needs does not answer, naming it, its address
    and the setting that names it, rather than after training or minutes of client retries."""
    services = []
    if REGISTRY in needs:
        services.append(("MLflow", config.tracking_uri, "MLFLOW_TRACKING_URI", "mint registry"))
    if WORKERS in needs:
        services += [
            ("serving worker", url, "MINT_WORKER_URLS", "mint serve") for url in config.worker_urls
        ]
    for name, url, setting, starter in services:
        if (cause := _unreachable(url + "/health")) is not None:
            raise ServiceError(
                f"{name} at {url} ({setting}) does not answer: {cause}; start it (`{starter}`, "
                f"or `mint up` for everything) or point {setting} at it"
            )


def _unreachable(url: str) -> str | None:
    """Why nothing answers at `url` (refused, timed out, unknown host); None when something
    does, whatever its answer."""
    try:
        with urllib.request.urlopen(url, timeout=5):
            return None
    except urllib.error.HTTPError:
        return None
    except urllib.error.URLError as e:
        return str(e.reason)
    except OSError as e:  # e.g. a timeout while reading the answer
        return str(e) or type(e).__name__


def _failure_line(command: str, error: Exception, log_path: Path | None) -> str:
    """The one line the terminal gets when `command` fails: what failed, and where the
    traceback went (appended to `log_path`)."""
    lines = str(error).strip().splitlines()
    what = lines[0].rstrip(":") if lines else ""
    if not isinstance(error, MintError):
        what = f"unexpected {type(error).__name__}" + (f": {what}" if what else "")
    if log_path is None:
        return f"mint {command}: {what}"
    try:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("a") as log:
            log.write(f"{datetime.now(UTC).isoformat()} mint {command} failed:\n")
            traceback.print_exception(error, file=log)
    except OSError:
        return f"mint {command}: {what}"
    return f"mint {command}: {what} (details in {log_path})"


if __name__ == "__main__":
    sys.exit(main())
