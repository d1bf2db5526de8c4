"""Rolling a revision out: admit -> prewarm -> (evaluation gate) -> (approval) -> activate.

One sequence for every way a revision reaches users: a release, an import, a promotion, a
rollback (which skips the gates: it returns to a revision that served users before, and must
be quick), an RL sync (to its `rl` alias, ungated), and a canary, which takes the revision in
(`take_in`) and activates it later, on its figures. The roll-out slot of the adapter is held
while the fleet takes the revision in and while an alias moves, but not while a reviewer
thinks: a paused approval never blocks a rollback. Every alias move needs the slot as a value
(`tasks.pipeline.rollout_lock` yields it), so none can happen outside it.
"""

import contextlib
import time
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from flows.approval import await_approval
from mint_core.config import MintConfig
from mint_core.errors import MintError, RejectedError, RolloutBusyError
from mint_core.registry import Registry, RolloutSlot
from mint_core.revisions import PRODUCTION, RevisionId
from tasks.pipeline import (
    Fleet,
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
    alias: str = PRODUCTION,
    gated: bool = True,
    fleet: Fleet | None = None,
) -> Fleet:
    """Make `revision` what `name@alias` serves once every worker of its base has it ready
    and, when `gated` (and not a `rollback`), it has passed its adapter's gates. A failure is
    recorded on the revision (stage `failed`, or `rejected` by a gate) and raised; the alias
    stays where it was. The fleet that holds it (`fleet`: the one a caller resolved before)."""
    timed = timed or StageClock()
    registry = Registry(config.tracking_uri)
    try:
        with rollout_lock(revision.adapter) as slot:
            fleet = take_in(config, revision, slot, actor, timed, rollback, fleet)
            gates = registry.gates.of(revision.adapter) if gated and not rollback else None
            evaluation = None
            if gates is not None:
                evaluation = timed(
                    "evaluate", evaluate_revision, config, revision, gates, actor, fleet=fleet
                )
        approver = ""
        if gates is not None and gates.requires_approval:
            approver = timed("approval", await_approval, config, revision, gates, actor, evaluation)
        with rollout_lock(revision.adapter) as slot:
            timed(
                "activate",
                activate_revision,
                config,
                revision,
                alias,
                actor,
                reason,
                approver=approver,
                fleet=fleet,
                slot=slot,
            )
    except (RolloutBusyError, RejectedError):
        raise  # it only waited, or a gate already recorded why it stopped
    except Exception as e:
        # Record the failure on the revision, but never let recording it hide the cause.
        with contextlib.suppress(MintError):
            registry.stages.mark_failed(revision, f"{type(e).__name__}: {e}", actor)
        raise
    return fleet


def take_in(
    config: MintConfig,
    revision: RevisionId,
    slot: RolloutSlot,
    actor: str,
    timed: StageClock | None = None,
    rollback: bool = False,
    fleet: Fleet | None = None,
) -> Fleet:
    """admit -> prewarm: the workers that are to hold `revision` take it in and report it
    ready, its stages recorded as `actor`'s. Inside its adapter's roll-out (`slot`, held), so
    that no other roll-out of the adapter admits at once. The fleet that holds it."""
    slot.check(revision.adapter)
    timed = timed or StageClock()
    fleet = timed("admit", admit_revision, config, revision, rollback, fleet, actor)
    timed("prewarm", prewarm_revision, config, revision, fleet=fleet, actor=actor)
    return fleet
