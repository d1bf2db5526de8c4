"""Commands that read what is registered and served: `mint status`, `mint usage` (each
principal's use of each revision, over the fleet), `mint pull` (a revision's files, out of
MinT) and `mint catalog snapshot` (the catalog workers start from)."""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from control.status import fleet_health, fleet_usage, format_table, status_rows, worker_rows
from mint_cli.options import REF, REGISTRY
from mint_core.usage import UsageBy, UsageFormat, report

if TYPE_CHECKING:
    from mint_cli.options import Commands
    from mint_core.config import MintConfig


def cmd_status(args: argparse.Namespace, config: MintConfig) -> None:
    fleet = fleet_health(config)
    print(format_table(worker_rows(config, fleet)))
    print()
    print(format_table(status_rows(config, fleet)))


def cmd_usage(args: argparse.Namespace, config: MintConfig) -> None:
    rows, kept_since, missing = fleet_usage(config, args.since)
    for url in missing:
        print(f"worker {url} did not answer: its usage is not in this report", file=sys.stderr)
    if kept_since > args.since:
        print(
            f"the fleet knows usage only from {_when(kept_since)} on (workers keep a day of it)",
            file=sys.stderr,
        )
    print(report(rows, args.by, args.format, args.since))


_UNITS_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def since_arg(text: str) -> float:
    """`--since`: how long ago (`90m`, `24h`, `7d`) or when (ISO 8601, e.g. 2026-12-05T09:00,
    local time unless it says otherwise), as Unix time."""
    text = text.strip()
    if text[-1:] in _UNITS_S and text[:-1].replace(".", "", 1).isdigit():
        return time.time() - float(text[:-1]) * _UNITS_S[text[-1]]
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a time: write how long ago (90m, 24h, 7d) or when (2026-12-05T09:00)"
        ) from None


def _when(at: float) -> str:
    return datetime.fromtimestamp(at).isoformat(sep=" ", timespec="minutes")


def cmd_pull(args: argparse.Namespace, config: MintConfig) -> None:
    from mint_core.artifacts.pulling import pull
    from mint_core.artifacts.stores import open_store
    from mint_core.registry import Registry

    pulled = pull(Registry(config.tracking_uri), open_store(config), args.ref, args.to, args.base)
    print(
        f"pulled {pulled.revision} into {pulled.folder} (content {pulled.content_digest}, "
        f"verified), a PEFT adapter over {pulled.base}: "
        f"AutoPeftModelForCausalLM.from_pretrained({str(pulled.folder)!r}) loads it"
    )


def cmd_catalog_snapshot(args: argparse.Namespace, config: MintConfig) -> None:
    # Not through the Prefect task: that module imports torch, which this needs not.
    from mint_core.artifacts.stores import open_store
    from mint_core.catalog.catalog import build_snapshot
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


def add_commands(commands: Commands) -> None:
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

    catalog = commands.add_parser("catalog", help="the catalog workers start from")
    catalog_commands = catalog.add_subparsers(dest="catalog_command", required=True)
    snapshot = catalog_commands.add_parser(
        "snapshot",
        help="read the whole registry into a catalog index and publish it in the artifact store",
    )
    snapshot.set_defaults(run=cmd_catalog_snapshot, needs=(REGISTRY,))

    status = commands.add_parser("status", help="every revision with aliases, stage, readiness")
    status.set_defaults(run=cmd_status, needs=(REGISTRY,))

    usage = commands.add_parser(
        "usage",
        help="each principal's use of each revision (requests, tokens, errors, 429s, time in "
        "queue), added up over every worker of the fleet",
    )
    usage.add_argument(
        "--since",
        type=since_arg,
        default="24h",
        help="how long ago (90m, 24h, 7d) or when (2026-12-05T09:00); default 24h",
    )
    usage.add_argument(
        "--by", type=UsageBy, choices=list(UsageBy), default=UsageBy.PRINCIPAL, help="group by"
    )
    usage.add_argument(
        "--format",
        type=UsageFormat,
        choices=list(UsageFormat),
        default=UsageFormat.TABLE,
        help="a table for a terminal, or CSV or JSON for a program",
    )
    usage.set_defaults(run=cmd_usage)
