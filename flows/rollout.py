"""Rolling a revision out: admit -> prewarm -> (evaluation gate) -> (approval) -> activate.

One sequence for every way a revision reaches `production`: a release, an import, a promotion,
a rollback (which skips the gates: it returns to a revision that served users before, and must
be quick). The roll-out slot of the adapter is held while the fleet takes the revision in and
while the alias moves, but not while a reviewer thinks: a paused approval never blocks a
rollback.
"""

import contextlib
import time
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from flows.approval import await_approval
from mint_core.config import MintConfig
from mint_core.errors import MintError, RejectedError, RolloutBusyError
from mint_core.registry import Registry
from mint_core.revisions import PRODUCTION, RevisionId
from tasks.pipeline import (
    activate_revision,
    admit_revision,
    evaluate_revision,
    prewarm_revision,
    rollout_lock,
)

P = ParamSpec("P")
R = TypeVar("R")


class StageClock:
    """Runs pipeline steps and records how long each took."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def __call__(self, stage: str, step: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        start = time.perf_counter()
        result = step(*args, **kwargs)
        self.seconds[stage] = time.perf_counter() - start
        return result


def roll_out(
    config: MintConfig,
    revision: RevisionId,
    actor: str,
    reason: str,
    rollback: bool = False,
    timed: StageClock | None = None,
) -> None:
    """Make `revision` what `name@production` serves once every worker of its base has it
    ready and it has passed its adapter's gates. A failure is recorded on the revision (stage
    `failed`, or `rejected` by a gate) and raised; `production` stays where it was."""
    timed = timed or StageClock()
    registry = Registry(config.tracking_uri)
    try:
        with rollout_lock(revision.adapter):
            fleet = timed("admit", admit_revision, config, revision, rollback=rollback)
            timed("prewarm", prewarm_revision, config, revision, fleet=fleet)
            gates = None if rollback else registry.gates(revision.adapter)
            evaluation = None
            if gates is not None:
                evaluation = timed(
                    "evaluate", evaluate_revision, config, revision, gates, actor, fleet=fleet
                )
        approver = ""
        if gates is not None and gates.requires_approval:
            approver = timed("approval", await_approval, config, revision, gates, actor, evaluation)
        with rollout_lock(revision.adapter):
            timed(
                "activate",
                activate_revision,
                config,
                revision,
                PRODUCTION,
                actor,
                reason,
                approver=approver,
                fleet=fleet,
            )
    except (RolloutBusyError, RejectedError):
        raise  # it only waited, or a gate already recorded why it stopped
    except Exception as e:
        # Record the failure on the revision, but never let recording it hide the cause.
        with contextlib.suppress(MintError):
            registry.mark_failed(revision, f"{type(e).__name__}: {e}", actor)
        raise
