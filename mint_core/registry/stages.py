"""A revision's stage in the release pipeline, and its history: each move is checked against
the stage table (`mint_core.states`) and appended to the revision's stage history tag
(`stage_log`: it starts with the steps before registration), and the version's description
table is written again from its tags (`mint_core.history`).

The operations take a revision by id (read here) or as a record already read, and return the
record as written: a caller walking a revision through several steps reads it once."""

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace

from mint_core.history import version_description
from mint_core.registry._mlflow import FAILURE_TAG, STAGE_HISTORY_TAG, STAGE_TAG, MlflowStore
from mint_core.registry.moves import done_moves, records_in
from mint_core.registry.revisions import RegisteredRevision, Revisions
from mint_core.registry.stage_log import history_entry
from mint_core.revisions import RevisionId
from mint_core.states import Stage, transition

FAILURE_CHARS = 4000
"""A failure's reason is cut to this in its stage history and its failure tag."""


@dataclass(frozen=True)
class Stages:
    """Stages and stage histories of revisions."""

    store: MlflowStore
    revisions: Revisions
    """Where a revision given by id is read."""

    def _record(self, revision: RevisionId | RegisteredRevision) -> RegisteredRevision:
        return (
            revision if isinstance(revision, RegisteredRevision) else self.revisions.get(revision)
        )

    def set(
        self,
        revision: RevisionId | RegisteredRevision,
        stage: Stage,
        actor: str = "mint",
        reason: str = "",
    ) -> RegisteredRevision:
        """Move a revision's recorded stage, refusing moves the stage table forbids, and append
        the move to the revision's stage history (shown by the MLflow UI as a tag). The
        revision as it is now recorded."""
        return self.walk(revision, (stage,), actor, reason)

    def walk(
        self,
        revision: RevisionId | RegisteredRevision,
        stages: Sequence[Stage],
        actor: str = "mint",
        reason: str = "",
    ) -> RegisteredRevision:
        """`set` to each of `stages` in turn, every move checked and in the history,
        written as one: the stage, the history and the description once each (three requests
        however many moves). The revision as it is now recorded."""
        registered = self._record(revision)
        if not stages:
            return registered
        history = json.loads(registered.tags.get(STAGE_HISTORY_TAG, "[]"))
        current = registered.stage
        for stage in stages:
            transition(current, stage)
            history.append(history_entry(current, stage, actor, reason))
            current = stage
        self.store.client.set_model_version_tag(
            registered.id.adapter, str(registered.id.number), STAGE_TAG, current.value
        )
        written = self._write_stage_history(registered, history)
        return replace(written, stage=current, tags={**written.tags, STAGE_TAG: current.value})

    def note(self, revision: RevisionId, actor: str, reason: str, approver: str = "") -> None:
        """Add a note to a revision's stage history, its stage staying as it is (from = to):
        what happened to it, such as a repair, that moved no stage. `approver`: the note is
        that person's approval of its roll-out."""
        registered = self.revisions.get(revision)
        self._append_stage_history(registered, registered.stage, actor, reason, approver)

    def history(self, revision: RevisionId) -> list[dict[str, str]]:
        return json.loads(self.revisions.get(revision).tags.get(STAGE_HISTORY_TAG, "[]"))

    def mark_failed(self, revision: RevisionId, reason: str, actor: str = "mint") -> None:
        """Record that a pipeline step failed for `revision`, and why."""
        self.set(revision, Stage.FAILED, actor, reason[:FAILURE_CHARS])
        self.store.client.set_model_version_tag(
            revision.adapter, str(revision.number), FAILURE_TAG, reason[:FAILURE_CHARS]
        )

    def _append_stage_history(
        self,
        registered: RegisteredRevision,
        stage: Stage,
        actor: str,
        reason: str,
        approver: str = "",
    ) -> RegisteredRevision:
        history = json.loads(registered.tags.get(STAGE_HISTORY_TAG, "[]"))
        history.append(history_entry(registered.stage, stage, actor, reason, approver))
        return self._write_stage_history(registered, history)

    def _write_stage_history(
        self, registered: RegisteredRevision, history: list[dict[str, str]]
    ) -> RegisteredRevision:
        value = json.dumps(history)
        self.store.client.set_model_version_tag(
            registered.id.adapter, str(registered.id.number), STAGE_HISTORY_TAG, value
        )
        return self.describe(
            replace(registered, tags={**registered.tags, STAGE_HISTORY_TAG: value})
        )

    def describe(self, registered: RegisteredRevision) -> RegisteredRevision:
        """Write the version's history table (`mint_core.history`) from its tags: its stage
        history and the alias moves recorded on it. Called wherever those tags are written;
        the revision with that description."""
        moves = done_moves(records_in(registered.tags))
        history = json.loads(registered.tags.get(STAGE_HISTORY_TAG, "[]"))
        description = version_description(registered.description, history, moves)
        self.store.client.update_model_version(
            registered.id.adapter, str(registered.id.number), description=description
        )
        return replace(registered, description=description)
