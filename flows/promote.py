"""Promote and rollback: put an existing revision in front of users, never retraining.

promote = (re-export if its artifact is lost) -> admit -> prewarm -> activate.
rollback = promote of the revision `production` pointed at before (or the one named).
"""

import contextlib

from prefect import flow

from mint_core.config import MintConfig
from mint_core.errors import ConfigurationError, MintError, RolloutBusyError
from mint_core.registry import Registry
from mint_core.revisions import PRODUCTION, RevisionId, check_adapter_name
from mint_core.states import Stage
from tasks.pipeline import (
    activate_revision,
    admit_revision,
    ensure_exported,
    prewarm_revision,
    rollout_lock,
)


def roll_out(
    config: MintConfig, revision: RevisionId, actor: str, reason: str, rollback: bool = False
) -> str:
    """Make `revision` what `name@production` serves, once every worker has it ready. Workers
    prewarm a rollback before anything else they have queued."""
    registry = Registry(config.tracking_uri)
    current = registry.get(revision)
    if current.stage is Stage.ACTIVE and PRODUCTION in current.aliases:
        raise ConfigurationError(
            f"{revision} is already {revision.adapter}@{PRODUCTION}; if workers cannot load it "
            f"(a damaged artifact), repair it: mint repair --adapter {revision.adapter} "
            f"--revision {revision.number}"
        )
    ensure_exported(config, revision)
    try:
        with rollout_lock(revision.adapter):
            admit_revision(config, revision, rollback=rollback)
            prewarm_revision(config, revision)
            activate_revision(config, revision, actor=actor, reason=reason)
    except RolloutBusyError:
        raise  # it only waited: the revision's stage stays as it was
    except Exception as e:
        # The alias has not moved; record why the revision could not be rolled out.
        with contextlib.suppress(MintError):
            registry.mark_failed(revision, f"{type(e).__name__}: {e}", actor)
        raise
    return str(revision)


@flow(name="promote")
def promote(adapter: str, revision: int, actor: str = "mint", reason: str = "promote") -> str:
    """Serve `adapter:r<revision>` as `adapter@production`."""
    config = MintConfig.from_env()
    return roll_out(config, RevisionId(check_adapter_name(adapter), revision), actor, reason)


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
    return roll_out(config, target, actor, reason, rollback=True)
