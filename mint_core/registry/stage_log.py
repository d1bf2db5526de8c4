"""A revision's stage history as records: one entry per stage change (time, from, to, actor,
reason, and the approver of an approval), kept as a JSON list in the `mint.stage_history` tag
(`Stages`). Its first entries are the pipeline's steps before the registry knew the revision
(trained, frozen, packed, exported: `StageMark`s carried to registration, which writes them
with `registered` in the version's first write, so recording them costs no request). Pure:
no MLflow calls."""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Self

from mint_core.errors import TransitionError
from mint_core.registry._mlflow import REASON_CHARS, now
from mint_core.states import Stage, transition

UNREGISTERED = (Stage.TRAINED, Stage.FROZEN, Stage.PACKED, Stage.EXPORTED)
"""The stages a revision goes through before it is registered, in order."""


@dataclass(frozen=True)
class StageMark:
    """A stage an adapter reached on its way to becoming a revision, and when."""

    stage: Stage
    at: str
    """ISO-8601 UTC time it was reached."""
    reason: str = ""
    """What it came to, e.g. the frozen files' digest."""

    @classmethod
    def reached(cls, stage: Stage, reason: str = "") -> Self:
        """`stage`, reached now."""
        return cls(stage, now(), reason)


def history_entry(
    before: Stage | None,
    after: Stage,
    actor: str,
    reason: str,
    approver: str = "",
    at: str | None = None,
) -> dict[str, str]:
    """One move in a stage history, at `at` (default: now); `before` None for the first."""
    entry = {"at": at or now(), "from": before.value if before else "", "to": after.value}
    entry |= {"actor": actor, "reason": reason[:REASON_CHARS]}
    return entry | ({"approver": approver} if approver else {})


def first_history(marks: Sequence[StageMark], actor: str) -> list[dict[str, str]]:
    """The stage history a revision is registered with: each of `marks` in order (from
    `trained` on; none for a caller that did not follow the pipeline's steps), then
    `registered`, now, every move checked against the stage table, all as `actor`'s."""
    if marks and marks[0].stage is not Stage.TRAINED:
        raise TransitionError(
            f"a revision's history starts at {Stage.TRAINED}, not {marks[0].stage}: mark the "
            f"pipeline's steps in order ({', '.join(UNREGISTERED)})"
        )
    history = []
    current: Stage | None = None
    for mark in (*marks, StageMark.reached(Stage.REGISTERED)):
        if current is not None:
            transition(current, mark.stage)
        history.append(history_entry(current, mark.stage, actor, mark.reason, at=mark.at))
        current = mark.stage
    return history
