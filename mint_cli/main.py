"""`mint`: the command line, the outermost layer (it may import flows and serving; nothing
imports it). Environment variables are read here and at the other edges, never on import.

Every command starts quickly (this package imports no torch, transformers, MLflow or Prefect;
each command imports what it drives), checks its arguments and the services it needs before
starting anything, and fails with one line, `mint <command>: <what failed>`, its traceback
going to a log file under MINT_HOME/logs. SIGINT and SIGTERM stop whatever a command started.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import traceback
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from mint_cli import catalog, flows, rollout, services, training
from mint_cli.options import REGISTRY, WORKERS
from mint_core.errors import MintError, ServiceError
from mint_core.membership import FleetSource, current_fleet
from mint_core.registry_accounts import USERNAME_VARIABLE, RegistryAccounts

if TYPE_CHECKING:
    from mint_core.config import MintConfig

COMMAND_GROUPS = (training, rollout, catalog, services, flows)
"""The modules whose `add_commands` make up `mint`, in the order `mint --help` lists them."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mint",
        description="Release, serve and govern LoRA adapter revisions over one resident base.",
    )
    # What each command needs running, whether it is a service that runs until stopped (its
    # own logs go to the terminal), and whether it loads models in this process.
    # `check` refuses bad inputs that need no service, before anything is loaded or started.
    # `runs_pipeline`: whether it waits out an MLflow outage (MINT_REGISTRY_RETRY_S); by default
    # every command but a service (a worker must answer at once, from what it holds).
    parser.set_defaults(needs=(), service=False, loads_models=False, check=None, runs_pipeline=None)
    commands = parser.add_subparsers(dest="command", required=True)
    for group in COMMAND_GROUPS:
        group.add_commands(commands)
    return parser


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


def _wait_out_registry_outages(config: MintConfig, command: str, terminal: bool) -> None:
    """Calls to MLflow wait out an outage for up to MINT_REGISTRY_RETRY_S, saying so in one
    line (and again when it is over; on the `terminal` too for a command whose logs go to a
    file), instead of MLflow's client retrying each request on its own schedule for minutes
    with a urllib3 warning per try."""
    from mint_core.registry_outages import LOGGER, wait_out_registry_outages

    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    wait_out_registry_outages(config.registry_retry_s)
    outages = logging.getLogger(LOGGER)
    outages.setLevel(logging.WARNING)
    if terminal:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"mint {command}: %(message)s"))
        outages.addHandler(handler)


def quiet_libraries() -> None:
    """Drop progress bars and deprecation chatter that the libraries print on every load."""
    import warnings

    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if argv is not None:  # a test calling `main`, not the `mint` program
        return _run(args)
    ending = _EndWithoutTeardown()
    atexit.register(ending)  # before the libraries register theirs: it runs after them all
    ending.code = _run(args)
    return ending.code


class _EndWithoutTeardown:
    """Run at exit once every other exit hook has run, it ends the process at once with
    `code`, skipping the interpreter's teardown: freeing every module of torch, Prefect and
    MLflow took 9.7 s on two busy cores (`mint flows serve` exited 11.5 s after SIGTERM, its
    runner stopped after 0.9 s; a flow stopped by SIGTERM spent 4.7 s of its 6.2 s there),
    which a command stopped by a supervisor (`mint up`, an orchestrator) spends in its grace
    period. Its cleanup is done by then: its `finally` blocks, the threads Python joins and
    every other exit hook (Prefect's log and event workers flush theirs, its temporary server
    stops) have run."""

    def __init__(self) -> None:
        self.code = 1
        """The exit status; 1 unless the command returns one."""

    def __call__(self) -> None:
        logging.shutdown()  # registered before this hook, so it would run after it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(self.code)


def _run(args: argparse.Namespace) -> int:
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
            runs_pipeline = not args.service if args.runs_pipeline is None else args.runs_pipeline
            if runs_pipeline:
                _wait_out_registry_outages(config, command, terminal=not args.service)
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
            if args.service and not isinstance(e, MintError):
                # A service's terminal is its log (a child worker's is the file its start error
                # quotes): an unexpected failure's traceback goes there, beside its own lines.
                traceback.print_exception(e, file=sys.stderr)
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
    if WORKERS in needs and config.fleet.source is FleetSource.STATIC:
        services += [
            ("serving worker", url, "MINT_WORKER_URLS", "mint serve") for url in config.worker_urls
        ]
    for name, url, setting, starter in services:
        if (cause := _unreachable(url + "/health")) is not None:
            raise ServiceError(
                f"{name} at {url} ({setting}) does not answer: {cause}; start it (`{starter}`, "
                f"or `mint up` for everything) or point {setting} at it"
            )
    if WORKERS in needs and config.fleet.source is not FleetSource.STATIC:
        # Workers come and go: one that answers is enough; the roll-out leaves out the rest.
        fleet = current_fleet(config)
        causes = [f"{url}: {cause}" for url in fleet if (cause := _unreachable(url + "/health"))]
        if len(causes) == len(fleet):
            raise ServiceError(
                f"no serving worker of the fleet answers ({'; '.join(causes)}); start one "
                "(`mint serve` with MINT_FLEET=registry announces itself)"
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
