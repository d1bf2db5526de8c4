"""Promote and rollback: put an existing revision in front of users, never retraining.

promote = (re-export if its artifact is lost) -> the roll-out (admit -> prewarm -> gates ->
activate). rollback = promote of the revision `production` pointed at before (or the one named),
past the gates.
"""

from collections.abc import Mapping

from prefect import flow

from flows.ending import ends_on_mint_error
from flows.rollout import roll_out
from mint_core.config import MintConfig
from mint_core.errors import NotFoundError
from mint_core.registry import Registry
from mint_core.revisions import PRODUCTION, RevisionId, RevisionRef, check_adapter_name
from tasks.pipeline import ensure_exported
from tasks.runs import label_run, production_move, run_name, summarize


def promote_to_production(
    config: MintConfig, revision: RevisionId, actor: str, reason: str, rollback: bool = False
) -> str:
    """Make `revision` what `name@production` serves, once every worker has it ready. Workers
    prewarm a rollback before anything else they have queued."""
    Registry(config.tracking_uri).revisions.get(revision).check_promotable()
    ensure_exported(config, revision)
    roll_out(config, revision, actor, reason, rollback)
    moved = production_move(config, revision.adapter)
    done = "rolled back" if rollback else "promoted"
    summarize(
        revision.adapter,
        f"{done} {revision.adapter}@{PRODUCTION} to {revision}",
        {"production": moved, "actor": actor, "reason": reason},
    )
    return str(revision)


@flow(name="promote", flow_run_name="promote {adapter} r{revision}")
@ends_on_mint_error
def promote(adapter: str, revision: int, actor: str = "mint", reason: str = "promote") -> str:
    """Serve `adapter:r<revision>` as `adapter@production`.

    Args:
        adapter: The adapter, e.g. `support-bot`.
        revision: The number N of the revision `adapter:rN` to serve as production.
        actor: Your name: recorded as who moved production (stage and alias histories).
        reason: Why; recorded with the move.
    """
    config = MintConfig.from_env()
    label_run(check_adapter_name(adapter))
    return promote_to_production(config, RevisionId(adapter, revision), actor, reason)


def _rollback_name(parameters: Mapping[str, object]) -> str:
    to = parameters.get("to_revision")
    return f"rollback {parameters['adapter']}" + (f" →r{to}" if to is not None else "")


@flow(name="rollback", flow_run_name=run_name(_rollback_name))
@ends_on_mint_error
def rollback(
    adapter: str, to_revision: int | None = None, actor: str = "mint", reason: str = "rollback"
) -> str:
    """Return `adapter@production` to the revision it pointed at before, or to `to_revision`.

    Args:
        adapter: The adapter, e.g. `support-bot`.
        to_revision: The revision number to return to; empty: the one production pointed at
            before its current one.
        actor: Your name: recorded as who rolled back (stage and alias histories).
        reason: Why; recorded with the move.
    """
    config = MintConfig.from_env()
    label_run(check_adapter_name(adapter))
    target = (
        RevisionId(adapter, to_revision)
        if to_revision is not None
        else Registry(config.tracking_uri).aliases.previous(adapter)
    )
    try:
        current = (
            f"r{Registry(config.tracking_uri).revisions.resolve(RevisionRef(adapter)).id.number}"
        )
    except NotFoundError:
        current = "none"
    label_run(adapter, f"rollback {adapter} {current}→r{target.number}")
    return promote_to_production(config, target, actor, reason, rollback=True)
