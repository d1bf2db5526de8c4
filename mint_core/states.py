"""Closed sets of states with explicit transition tables.

`Stage` is where a revision is in the release pipeline (recorded on its MLflow model version);
`Readiness` is where a revision is on one serving worker. Each changes only through
`transition()`, which refuses any move its table does not list.
"""

from collections.abc import Mapping
from enum import StrEnum
from typing import TypeVar

from mint_core.errors import TransitionError


class Stage(StrEnum):
    """A revision's place in the release pipeline."""

    TRAINED = "trained"
    """A PEFT adapter directory exists."""
    FROZEN = "frozen"
    """Weights copied into immutable files with digests."""
    PACKED = "packed"
    """Tensors packed into shards plus an index."""
    EXPORTED = "exported"
    """The packed artifact is in the artifact store, content-addressed."""
    REGISTERED = "registered"
    """An MLflow model version exists; no user can reach it yet."""
    ADMITTED = "admitted"
    """The serving fleet has been asked to take it in."""
    PREWARMING = "prewarming"
    """Workers are loading it and running a warm-up forward."""
    READY = "ready"
    """Every worker reports it ready."""
    ACTIVE = "active"
    """`production` points at it: users get it."""
    RETIRED = "retired"
    """It was active and has been replaced; still addressable as `name:rN`."""
    FAILED = "failed"
    """A step failed; the reason is recorded."""
    REJECTED = "rejected"
    """Stopped before activation by a gate (evaluation, approval or canary); the figures or
    the reviewer's decision are the recorded reason. Still addressable as `name:rN`."""


_STAGE_MOVES: Mapping[Stage, frozenset[Stage]] = {
    Stage.TRAINED: frozenset({Stage.FROZEN, Stage.FAILED}),
    Stage.FROZEN: frozenset({Stage.PACKED, Stage.FAILED}),
    Stage.PACKED: frozenset({Stage.EXPORTED, Stage.FAILED}),
    Stage.EXPORTED: frozenset({Stage.REGISTERED, Stage.FAILED}),
    Stage.REGISTERED: frozenset({Stage.ADMITTED, Stage.FAILED}),
    Stage.ADMITTED: frozenset({Stage.PREWARMING, Stage.FAILED}),
    Stage.PREWARMING: frozenset({Stage.READY, Stage.FAILED}),
    # A ready revision that was not activated can be promoted later.
    Stage.READY: frozenset({Stage.ACTIVE, Stage.ADMITTED, Stage.FAILED, Stage.REJECTED}),
    Stage.ACTIVE: frozenset({Stage.RETIRED}),
    # A retired or failed revision can be promoted again (rollback, retry).
    Stage.RETIRED: frozenset({Stage.ADMITTED}),
    Stage.FAILED: frozenset({Stage.ADMITTED}),
    # A rejected revision can be promoted again (another try at the gates).
    Stage.REJECTED: frozenset({Stage.ADMITTED}),
}


class Readiness(StrEnum):
    """A revision's state on one serving worker."""

    NOT_ADMITTED = "not_admitted"
    """The worker has not been asked to hold it."""
    QUEUED = "queued"
    """Admitted, waiting for a prewarm slot."""
    FETCHING = "fetching"
    """Prewarm phase 1: fetching and verifying its artifact into the host cache."""
    WARMING = "warming"
    """Prewarm phase 2: loading it into a device slot and running a warm-up forward."""
    READY = "ready"
    """In the host cache and warmed: requests for it are served."""
    FAILED = "failed"
    """Prewarm failed; the reason is kept. It can be admitted again."""


_READINESS_MOVES: Mapping[Readiness, frozenset[Readiness]] = {
    Readiness.NOT_ADMITTED: frozenset({Readiness.QUEUED}),
    Readiness.QUEUED: frozenset({Readiness.FETCHING, Readiness.FAILED}),
    # From prewarm back to not admitted: the engine went away under it (admitted again later).
    Readiness.FETCHING: frozenset({Readiness.WARMING, Readiness.FAILED, Readiness.NOT_ADMITTED}),
    Readiness.WARMING: frozenset({Readiness.READY, Readiness.FAILED, Readiness.NOT_ADMITTED}),
    # Evicted from the host cache: it must be admitted again before it serves.
    Readiness.READY: frozenset({Readiness.NOT_ADMITTED}),
    Readiness.FAILED: frozenset({Readiness.QUEUED}),
}

State = TypeVar("State", Stage, Readiness)


def transition(current: State, target: State) -> State:
    """`target`, if the table allows moving there from `current`; otherwise TransitionError."""
    table: Mapping[State, frozenset[State]] = (
        _STAGE_MOVES if isinstance(current, Stage) else _READINESS_MOVES  # type: ignore[assignment]
    )
    allowed = table[current]
    if target not in allowed:
        options = ", ".join(sorted(allowed)) or "nothing"
        kind = type(current).__name__.lower()
        raise TransitionError(
            f"{kind} cannot move from {current!s} to {target!s}; from {current!s} it can move "
            f"to: {options}"
        )
    return target
