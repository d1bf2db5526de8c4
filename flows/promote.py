"""Promote and rollback: put an existing revision in front of users, never retraining.

promote = (re-export if its artifact is lost) -> the roll-out (admit -> prewarm -> gates ->
activate). rollback = promote of the revision `production` pointed at before (or the one named),
past the gates.
"""

from prefect import flow

from flows.rollout import roll_out
from mint_core.config import MintConfig
from mint_core.registry import Registry
from mint_core.revisions import RevisionId, check_adapter_name
from tasks.pipeline import ensure_exported


def promote_to_production(
    config: MintConfig, revision: RevisionId, actor: str, reason: str, rollback: bool = False
) -> str:
    """Make `revision` what `name@production` serves, once every worker has it ready. Workers
    prewarm a rollback before anything else they have queued."""
    Registry(config.tracking_uri).get(revision).check_promotable()
    ensure_exported(config, revision)
    roll_out(config, revision, actor, reason, rollback)
    return str(revision)


@flow(name="promote")
def promote(adapter: str, revision: int, actor: str = "mint", reason: str = "promote") -> str:
    """Serve `adapter:r<revision>` as `adapter@production`."""
    config = MintConfig.from_env()
    return promote_to_production(
        config, RevisionId(check_adapter_name(adapter), revision), actor, reason
    )


@flow(name="rollback")
def rollback(
    adapter: str, to_revision: int | None = None, actor: str = "mint", reason: str = "rollback"
) -> str:
    """Return `adapter@production` to the revision it pointed at before, or to `to_revision`."""
    config = MintConfig.from_env()
    check_adapter_name(adapter)
    target = (
        RevisionId(adapter, to_revision)
        if to_revision is not None
        else Registry(config.tracking_uri).previous(adapter)
    )
    return promote_to_production(config, target, actor, reason, rollback=True)
