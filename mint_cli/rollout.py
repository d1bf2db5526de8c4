"""Commands that move what users get: `mint promote`, `rollback`, `repair`, `canary`,
`approve`, and `gates` (what a roll-out must pass) and `history` (every alias move)."""

from __future__ import annotations

import argparse
import getpass
from collections.abc import Callable
from dataclasses import fields
from typing import TYPE_CHECKING

from control.status import format_table
from mint_cli.options import (
    DATA,
    PRINCIPAL,
    REGISTRY,
    REVISION,
    WORKERS,
    FlowOptions,
    actor_option,
    adapter_argument,
    adapter_option,
    given,
    option,
    real,
    revision_option,
    whole,
)
from mint_core.config import CANARY_MIN_REQUESTS, CANARY_PERCENT, CANARY_WINDOW_S
from mint_core.gates import Gates

if TYPE_CHECKING:
    from mint_cli.options import Commands
    from mint_core.config import MintConfig

GATE_OPTIONS = tuple(gate.name for gate in fields(Gates))
"""`mint gates` options: each given one changes that gate of the adapter (mint_core/gates.py)."""


def cmd_promote(args: argparse.Namespace, config: MintConfig) -> None:
    parameters = {"adapter": args.adapter, "revision": args.revision, "actor": args.actor}
    if _ran_where_served("promote/promote", parameters | given(args)):
        return
    from mint_core.registry import Registry
    from mint_core.revisions import RevisionId

    # Refused before Prefect starts: unknown, or already production.
    Registry(config.tracking_uri).revisions.get(
        RevisionId(args.adapter, args.revision)
    ).check_promotable()
    from flows.promote import promote

    served = promote(args.adapter, args.revision, actor=args.actor, **given(args))
    print(f"{args.adapter}@production is now {served}")


def cmd_rollback(args: argparse.Namespace, config: MintConfig) -> None:
    parameters = {"adapter": args.adapter, "to_revision": args.to_revision, "actor": args.actor}
    if _ran_where_served("rollback/rollback", parameters | given(args)):
        return
    from mint_core.registry import Registry
    from mint_core.revisions import RevisionId

    # Refused before Prefect starts: nothing to roll back to, or that is production already.
    registry = Registry(config.tracking_uri)
    target = (
        RevisionId(args.adapter, args.to_revision)
        if args.to_revision is not None
        else registry.aliases.previous(args.adapter)
    )
    registry.revisions.get(target).check_promotable()
    from flows.promote import rollback

    served = rollback(args.adapter, args.to_revision, actor=args.actor, **given(args))
    print(f"{args.adapter}@production is now {served}")


def _ran_where_served(deployment: str, parameters: dict[str, object]) -> bool:
    """Whether the run was handed to the runner serving `deployment` (and completed there):
    it starts warm there, so the command need not import Prefect and MLflow (control.handoff).
    Where nothing serves it, the command runs the flow itself."""
    from control.handoff import run_where_served

    run = run_where_served(deployment, parameters)
    if run is not None:
        print(f"{run.summary} (run {run.name!r}: {run.url})")
    return run is not None


def cmd_repair(args: argparse.Namespace, config: MintConfig) -> None:
    from flows.repair import repair

    report = repair(args.adapter, args.revision, actor=args.actor, **given(args))
    artifact = "exported again from its frozen files" if report.exported_again else "intact"
    fleet = (
        f"ready again on {report.workers} worker(s)"
        if report.workers
        else "not re-admitted, as no production or candidate alias names it"
    )
    print(f"repaired {report.revision}: artifact {artifact}; {fleet}")


def cmd_canary(args: argparse.Namespace, config: MintConfig) -> None:
    from flows.canary import canary

    report = canary(args.adapter, args.revision, actor=args.actor, **given(args))
    print(f"{report.revision} {report.reason}")


def cmd_approve(args: argparse.Namespace, config: MintConfig) -> None:
    from flows.approval import Verdict, answer_approval
    from mint_core.revisions import RevisionId

    verdict = Verdict.REJECT if args.reject else Verdict.APPROVE
    revision = RevisionId(args.adapter, args.revision)
    run_id = answer_approval(config, revision, verdict, args.reviewer, args.comment)
    print(f"{verdict} of {revision} sent to its paused roll-out (Prefect flow run {run_id})")


def cmd_gates(args: argparse.Namespace, config: MintConfig) -> None:
    from mint_core.registry import Registry

    registry = Registry(config.tracking_uri)
    changes = {name: getattr(args, name) for name in GATE_OPTIONS}
    gates = registry.gates.of(args.adapter)
    if any(value is not None for value in changes.values()):
        gates = gates.changed(**changes)
        registry.gates.set(args.adapter, gates)
    print(format_table([["gate", "value"], *map(list, gates.rows())]))


def cmd_history(args: argparse.Namespace, config: MintConfig) -> None:
    from mint_core.registry import Registry

    rows = [["time", "alias", "from", "to", "actor", "approver", "reason"]]
    for move in Registry(config.tracking_uri).aliases.history(args.adapter):
        before = f"r{move.from_revision}" if move.from_revision is not None else "-"
        rows.append([move.at, move.alias, before, f"r{move.to_revision}", move.actor,
                     move.approver or "-", move.reason or "-"])  # fmt: skip
    print(format_table(rows))


def cmd_grants(args: argparse.Namespace, config: MintConfig) -> None:
    from mint_core.registry import Registry

    grants = Registry(config.tracking_uri).grants
    for account in args.revoke or ():
        grants.revoke(args.adapter, account)
        print(f"revoked {account}'s grant on {args.adapter}")
    writers = grants.writers(args.adapter)
    if writers is None:
        print(f"{args.adapter}: the registry has no authentication; every client may write it")
        return
    rows = [["account", "permission", "admin"]]
    rows += [[g.account, g.permission, "yes" if g.admin else "-"] for g in writers]
    print(format_table(rows))
    left = [g.account for g in writers if g.account in (args.revoke or ())]
    if left:
        print(
            f"{', '.join(left)} may still write {args.adapter}: through a grant on every "
            "registered model or a role; an admin removes it in MLflow's account pages"
        )


def _fleet_command(
    commands: Commands,
    name: str,
    help: str,
    run: Callable[[argparse.Namespace, MintConfig], None],
    target: Callable[[argparse.ArgumentParser], None],
) -> None:
    """A command that brings one revision (`target` says which) to the whole fleet: the
    adapter, that revision, who does it and why (the flow's default reason: its name)."""
    command = commands.add_parser(name, help=help)
    adapter_option(command)
    target(command)
    actor_option(command)
    FlowOptions(command).add("--reason", help="why (recorded; default: the command's name)")
    command.set_defaults(run=run, needs=(REGISTRY, WORKERS))


_to_revision_option = option(
    "--to-revision", type=REVISION, default=None, help="N of rN (default: previous)"
)


def add_commands(commands: Commands) -> None:
    _fleet_command(
        commands,
        "promote",
        "serve an existing revision as production",
        cmd_promote,
        revision_option,
    )
    _fleet_command(
        commands,
        "rollback",
        "return production to its previous revision",
        cmd_rollback,
        _to_revision_option,
    )
    _fleet_command(
        commands,
        "repair",
        "export a revision again from its frozen files if its artifact is missing or damaged, "
        "and have every worker take it in again (no alias moves)",
        cmd_repair,
        revision_option,
    )

    grants = commands.add_parser(
        "grants",
        help="who may write an adapter in the registry (move its aliases); --revoke removes an "
        "account's grant (MinT registers only into adapters the pipeline and admins alone write)",
    )
    adapter_argument(grants)
    grants.add_argument(
        "--revoke", action="append", metavar="ACCOUNT", help="remove ACCOUNT's grant (repeat)"
    )
    grants.set_defaults(run=cmd_grants, needs=(REGISTRY,))

    history = commands.add_parser("history", help="every alias move of an adapter")
    adapter_argument(history)
    history.set_defaults(run=cmd_history, needs=(REGISTRY,))

    gates = commands.add_parser(
        "gates",
        help="show an adapter's gates (evaluation, approval, canary margins); options change them",
    )
    adapter_argument(gates)
    gates.add_argument("--eval-data", type=DATA, help="rows both revisions are scored on")
    gates.add_argument("--regression-data", type=DATA, help="further rows gated the same way")
    gates.add_argument(
        "--max-regression",
        type=real("max regression", 0, 1, closed_low=True),
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
        type=whole("approval timeout"),
        help="seconds to wait for an answer before rejecting",
    )
    gates.add_argument(
        "--canary-max-error-increase", type=real("error increase", 0, 1, closed_low=True)
    )
    gates.add_argument("--canary-max-p95-ratio", type=real("p95 ratio", 1, closed_low=True))
    gates.add_argument("--canary-max-score-drop", type=real("score drop", 0, 1, closed_low=True))
    gates.add_argument(
        "--replicas",
        type=whole("replicas", minimum=0),
        help="workers that hold each revision (0: the fleet's MINT_REPLICAS)",
    )
    gates.set_defaults(run=cmd_gates, needs=(REGISTRY,))

    approve = commands.add_parser(
        "approve", help="answer a roll-out paused for approval (as the Prefect UI's form does)"
    )
    adapter_argument(approve)
    revision_option(approve)
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
    adapter_argument(canary)
    revision_option(canary)
    watch = FlowOptions(canary)
    watch.add(
        "--percent",
        type=real("percent", 0),
        help="share of production's requests it gets, above 0 and at most 100 (default "
        f"{CANARY_PERCENT:g})",
    )
    watch.add(
        "--window",
        dest="window_s",
        metavar="WINDOW",
        type=real("window", 0),
        help=f"seconds to watch (default {CANARY_WINDOW_S:g})",
    )
    watch.add(
        "--min-requests",
        type=whole("min requests"),
        help="requests it must serve to be judged; the window grows up to 3x to get them "
        f"(default {CANARY_MIN_REQUESTS})",
    )
    actor_option(canary)
    canary.set_defaults(run=cmd_canary, needs=(REGISTRY, WORKERS))
