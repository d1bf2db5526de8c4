"""What `mint` commands share: argument types, the option groups several commands take (each
declared once here), and what a command needs running.

Argument types refuse a bad value through argparse, as one usage line, before anything starts.
"""

from __future__ import annotations

import argparse
import getpass
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from mint_core.backend_store import check_registry_db
from mint_core.config import LOOPBACK
from mint_core.errors import ConfigurationError
from mint_core.revisions import RevisionRef, check_adapter_name

if TYPE_CHECKING:
    Commands = argparse._SubParsersAction[argparse.ArgumentParser]
    """What `add_commands` of each command module adds its commands to."""

T = TypeVar("T")

REGISTRY = "registry"
WORKERS = "workers"
"""What a command needs running (`needs`), checked before it starts anything."""


def checked(check: Callable[[str], T], what: str) -> Callable[[str], T]:
    """An argparse type from one of MinT's checks: its ConfigurationError (which says what is
    wrong and what to write instead) becomes argparse's error for the argument."""

    def parse(text: str) -> T:
        try:
            return check(text)
        except ConfigurationError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = what
    return parse


def whole(what: str, minimum: int = 1, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type for a whole number from `minimum` (to `maximum`)."""

    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            bounds = f"from {minimum} to {maximum}" if maximum is not None else f"{minimum} or more"
            raise ConfigurationError(f"{what} {text!r} is not a whole number {bounds}")
        return value

    return checked(check, what)


def real(
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

    return checked(check, what)


def _revision(text: str) -> int:
    number = text.removeprefix("r")
    if not (number.isascii() and number.isdigit()) or int(number) < 1:
        raise ConfigurationError(f"revision {text!r} is not valid; write N or rN, e.g. 3 or r3")
    return int(number)


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


ADAPTER = checked(check_adapter_name, "adapter")
DATA = checked(_data, "data file")
FOLDER = checked(_folder, "folder")
PRINCIPAL = checked(_principal, "principal")
REVISION = checked(_revision, "revision")
REF = checked(RevisionRef.parse, "adapter reference")
PORT = whole("port", 1, 65535)
REGISTRY_DB = checked(check_registry_db, "backend store URI")


# Option groups several commands take.

Option = Callable[[argparse.ArgumentParser], None]
"""Adds an option (or argument) to a command."""


def option(*flags: str, **settings: Any) -> Option:
    """An option several commands take, declared once: argparse's `add_argument(*flags,
    **settings)` for each command it is given to."""

    def add(command: argparse.ArgumentParser) -> None:
        command.add_argument(*flags, **settings)

    return add


def adapter_option(command: argparse.ArgumentParser, help: str | None = None) -> None:
    """`--adapter NAME`, required (commands that name the adapter as their first argument
    take `adapter_argument`)."""
    command.add_argument("--adapter", type=ADAPTER, required=True, help=help)


def actor_option(command: argparse.ArgumentParser) -> None:
    # The user, not the flows' default (`mint`, for callers in code): a person is recorded.
    # Looked up when a command is built, not at import.
    command.add_argument("--actor", default=getpass.getuser(), help="who does it (recorded)")


adapter_argument = option("adapter", type=ADAPTER)
revision_option = option("--revision", type=REVISION, required=True, help="N or rN")
principal_option = option(
    "--principal",
    type=PRINCIPAL,
    action="append",
    help="who may use it (repeat; default everyone)",
)
base_model_option = option(
    "--base-model",
    default=None,
    help="the base to train on or check against (a model folder or hub id; default "
    "MINT_BASE_MODEL): the workers serving it take the revision",
)
backend_store_option = option(
    "--backend-store-uri",
    type=REGISTRY_DB,
    help="MLflow's database: postgresql://user:password@host:port/database or "
    "sqlite:///path (default: MINT_REGISTRY_DB, else sqlite under MINT_HOME)",
)


def address_options(command: argparse.ArgumentParser, port: int, advertise: bool = False) -> None:
    """`--host` and `--port` of a service that listens (and `--advertise-url`, for one others
    name by its URL)."""
    host_option(command)
    command.add_argument("--port", type=PORT, default=port)
    if advertise:
        advertise_option(command)


host_option = option(
    "--host",
    default=LOOPBACK,
    help=f"the address to listen on (default {LOOPBACK}: this machine only); beyond loopback "
    "the service must be guarded (keys, accounts, an auth string) or it refuses to start",
)
advertise_option = option(
    "--advertise-url",
    default="",
    help="the URL other hosts reach it at, when it is not http://<host>:<port> (needed with "
    "--host 0.0.0.0; a worker's name in placement: every host must use this one)",
)


class FlowOptions:
    """Options a command passes on to its flow as they are, and only when given: left out, the
    flow's own default holds, so each default is written once, in the flow's signature."""

    def __init__(self, command: argparse.ArgumentParser, title: str | None = None) -> None:
        self._group = command.add_argument_group(title) if title else command
        # One list per command, however many groups add to it: `mint release` has two (its
        # hyperparameters and its distributed launch), and a second list replaced the first,
        # dropping --steps, --rank and the others.
        names: list[str] | None = command.get_default("flow_options")
        if names is None:
            names = []
            command.set_defaults(flow_options=names)
        self._names = names

    def add(self, *flags: str, **settings: Any) -> None:
        action = self._group.add_argument(*flags, default=argparse.SUPPRESS, **settings)
        self._names.append(action.dest)


def given(args: argparse.Namespace) -> dict[str, object]:
    """The `FlowOptions` of the command that were given, by name."""
    names = getattr(args, "flow_options", ())
    return {name: getattr(args, name) for name in names if hasattr(args, name)}
