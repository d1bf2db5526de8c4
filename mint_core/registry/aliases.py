"""Aliases, what users get: moving one (with its history), pointing a working alias, dropping
one, and activation, the stage walk and alias move that puts a ready revision in front of users.

Every move the pipeline makes is also recorded as an intent (`mint_core.alias_intents`), so that
workers follow only the moves the pipeline made."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from mlflow.entities.model_registry import RegisteredModel
from mlflow.exceptions import MlflowException

from mint_core.alias_intents import INTENT_TAG, AliasIntent
from mint_core.errors import NotFoundError, TransitionError
from mint_core.history import adapter_description
from mint_core.registry._mlflow import ACTIVATED_AT_TAG, REASON_CHARS, MlflowStore, missing, now
from mint_core.registry.moves import AliasMove, MoveRecord, moves_made, records_in
from mint_core.registry.revisions import RegisteredRevision, Revisions
from mint_core.registry.slots import RolloutSlot
from mint_core.registry.stages import Stages
from mint_core.revisions import CANARY, CANDIDATE, PRODUCTION, RevisionId
from mint_core.states import Stage

ACTIVATABLE = (Stage.ADMITTED, Stage.PREWARMING, Stage.READY)
"""Stages from which activation can go on to `active`, in order."""


@dataclass(frozen=True)
class Aliases:
    """Alias moves, their history, and activation."""

    store: MlflowStore
    revisions: Revisions
    """Where a moved revision is read back."""
    stages: Stages
    """What activation walks, and what writes a version's history table."""

    def move(
        self,
        revision: RevisionId,
        alias: str,
        actor: str = "mint",
        reason: str = "",
        approver: str = "",
        *,
        slot: RolloutSlot,
    ) -> int | None:
        """Point `adapter@alias` at `revision`, record the move in the adapter's alias history,
        and return the revision the alias pointed at before (None if there was no such alias).
        `approver`: who approved the roll-out that makes this move. Any failure to read or
        write raises RegistryError: nothing is guessed. The version's and the adapter's
        descriptions show the history as tables (`mint_core.history`).

        The history record comes first, as an intent; then the alias moves; then the record is
        marked done. A mover killed anywhere leaves history and alias agreeing, with nothing to
        repair: killed before the record, nothing happened; killed after the record but before
        the alias moved, the record stays an intent that readers skip, since the alias was next
        seen elsewhere (`moves_made`); killed after the alias moved, readers count the intent,
        since the alias was next seen at its target.

        `slot`: the adapter's roll-out slot, held (`mint_core.registry.slots`): it serializes
        the adapter's moves, which keeps their numbers unique."""
        return self._move(revision, alias, actor, reason, approver, slot)[0].from_revision

    def _move(
        self,
        revision: RevisionId,
        alias: str,
        actor: str,
        reason: str,
        approver: str,
        slot: RolloutSlot,
        registered: RegisteredRevision | None = None,
        moved: Callable[[], None] | None = None,
    ) -> tuple[AliasMove, RegisteredRevision]:
        """`move`; the move and the revision as now recorded. `registered`: the revision
        as already read (its tags and description), saving a read. `moved` is called as soon
        as workers can see the move (alias, intent and the adapter's change time written),
        before the move's own records are finished."""
        slot.check(revision.adapter)
        model = self.store.model(revision.adapter)
        before = (model.aliases or {}).get(alias)
        records = self._move_records(revision.adapter)
        number = max((r.move.number for r in records), default=0)
        move = AliasMove(
            number + 1,
            now(),
            alias,
            int(before) if before is not None else None,
            revision.number,
            actor,
            reason[:REASON_CHARS],
            approver,
        )
        adapter, version = revision.adapter, str(revision.number)
        written: dict[str, str] = {}
        with self.store.failing(f"move {adapter}@{alias} to {revision}"):
            record = MoveRecord(move, done=False)
            self.store.client.set_model_version_tag(adapter, version, move.tag, record.to_tag())
            intent = AliasIntent(revision.number, move.from_revision, actor, move.at, done=False)
            self._intend(adapter, alias, intent)
            self.store.client.set_registered_model_alias(adapter, alias, version)
            self._intend(adapter, alias, replace(intent, done=True))
            aliases = {a: int(v) for a, v in (model.aliases or {}).items()}
            aliases[alias] = move.to_revision  # the move has happened: the table shows it
            self.touch(adapter, model, moves_made([*records, record], aliases))
            if moved is not None:
                moved()
            if alias != CANARY:  # a canary's moves (its start, its end) activate nothing
                self.store.client.set_model_version_tag(adapter, version, ACTIVATED_AT_TAG, move.at)
                written[ACTIVATED_AT_TAG] = move.at
            done = MoveRecord(move, done=True)
            self.store.client.set_model_version_tag(adapter, version, move.tag, done.to_tag())
            written[move.tag] = done.to_tag()
            if registered is None:
                registered = self.revisions.get(revision)
            else:
                named = tuple(sorted(a for a, n in aliases.items() if n == revision.number))
                registered = replace(registered, aliases=named, tags={**registered.tags, **written})
            registered = self.stages.describe(registered)
        return move, registered

    def point(self, revision: RevisionId, alias: str, actor: str = "mint") -> None:
        """Set `adapter@alias` to `revision` with no history: for working aliases such as
        `candidate`. Workers see the change at their next sync."""
        adapter = revision.adapter
        model = self.store.model(adapter)
        intent = _intent_from(model, alias, revision.number, actor)
        with self.store.failing(f"point {adapter}@{alias} at {revision}"):
            self._intend(adapter, alias, intent)
            self.store.client.set_registered_model_alias(adapter, alias, str(revision.number))
            self._intend(adapter, alias, replace(intent, done=True))
        self.touch(adapter, model)

    def drop(self, adapter: str, alias: str, actor: str = "mint") -> None:
        """Remove `adapter@alias` (nothing happens if it does not exist)."""
        model = self.store.model_or_none(adapter)
        if model is None:
            return
        intent = _intent_from(model, alias, None, actor)
        with self.store.failing(f"remove {adapter}@{alias}"):
            self._intend(adapter, alias, intent)
            try:
                self.store.client.delete_registered_model_alias(adapter, alias)
            except MlflowException as e:
                if not missing(e):
                    raise
            self._intend(adapter, alias, replace(intent, done=True))
        self.touch(adapter, model)

    def _intend(self, adapter: str, alias: str, intent: AliasIntent) -> None:
        """Record the pipeline's move of `adapter@alias` (see `mint_core.alias_intents`):
        workers follow an alias only where an intent accounts for it."""
        self.store.client.set_registered_model_tag(adapter, INTENT_TAG + alias, intent.to_tag())

    def touch(
        self,
        adapter: str,
        model: RegisteredModel | None = None,
        moves: Sequence[AliasMove] | None = None,
    ) -> None:
        """Mark `adapter` changed for workers' syncs (`model`: as already read, saving a read),
        rewriting its alias history table with `moves` when given. MLflow does not count an
        alias or tag change as an update of the registered model; re-setting its description
        does, and workers find changes by that time."""
        model = model or self.store.model_or_none(adapter)
        description = (model.description or "") if model else ""
        if moves is not None:  # the alias history table, rewritten with the moves made
            description = adapter_description(description, moves)
        self.store.client.update_registered_model(adapter, description=description)

    def reject(self, revision: RevisionId, actor: str, reason: str) -> None:
        """Record that a gate (evaluation, approval, canary) stopped `revision` before
        activation, and why; it stops being the adapter's `candidate`, so workers stop keeping
        it for a roll-out that will not come."""
        rejected = self.stages.set(revision, Stage.REJECTED, actor, reason)
        if CANDIDATE in rejected.aliases:
            self.drop(revision.adapter, CANDIDATE)

    def activate(
        self,
        registered: RegisteredRevision,
        alias: str = PRODUCTION,
        actor: str = "mint",
        reason: str = "release",
        approver: str = "",
        moved: Callable[[], None] | None = None,
        *,
        slot: RolloutSlot,
    ) -> int | None:
        """Put `registered`, ready on every worker of its base, in front of users: its stage
        walks on to `ready`, `alias` moves to it (`move`), its roll-out ends (`candidate`
        is dropped if it names it), its stage becomes `active`, and the revision `production`
        named before, if another, is `retired`. The revision `alias` named before. The caller
        has checked that its stage is one of `ACTIVATABLE` (`check_activatable`).

        `moved` is called as soon as workers can see the alias move, before the records that
        follow it: a caller nudges the workers then, so users get the revision without waiting
        for the rest of this. `slot`: the adapter's roll-out slot, held (`move`)."""
        revision = registered.id
        slot.check(revision.adapter)  # before the stage walk, which the move must not strand
        steps = ACTIVATABLE[ACTIVATABLE.index(registered.stage) + 1 :]
        registered = self.stages.walk(registered, steps, actor, "every worker reports it ready")
        move, registered = self._move(
            revision, alias, actor, reason, approver, slot, registered, moved
        )
        if CANDIDATE in registered.aliases:
            self.drop(revision.adapter, CANDIDATE)  # its roll-out is over
        self.stages.set(registered, Stage.ACTIVE, actor, reason)
        previous = move.from_revision
        if alias == PRODUCTION and previous is not None and previous != revision.number:
            self.stages.set(RevisionId(revision.adapter, previous), Stage.RETIRED, actor, reason)
        return previous

    def history(self, adapter: str) -> list[AliasMove]:
        """Every alias move of `adapter` that happened, oldest first (see `move`)."""
        return self._now_and_moves(adapter)[1]

    def previous(self, adapter: str, alias: str = PRODUCTION) -> RevisionId:
        """The revision `alias` pointed at before its current one: what a rollback returns to."""
        aliases, history = self._now_and_moves(adapter)
        current = aliases.get(alias)
        if current is None:
            raise NotFoundError(f"{adapter}@{alias} does not exist in the registry")
        for move in reversed(history):
            if move.alias != alias or move.to_revision != current:
                continue
            if move.from_revision is not None and move.from_revision != current:
                return RevisionId(adapter, move.from_revision)
            break
        raise NotFoundError(
            f"{adapter}@{alias} has no earlier revision to roll back to; name one with "
            "--to-revision"
        )

    def _now_and_moves(self, adapter: str) -> tuple[dict[str, int], list[AliasMove]]:
        """Where `adapter`'s aliases point now, and the moves that took them there."""
        model = self.store.model(adapter)
        aliases = {alias: int(version) for alias, version in (model.aliases or {}).items()}
        return aliases, moves_made(self._move_records(adapter), aliases)

    def _move_records(self, adapter: str) -> list[MoveRecord]:
        """Every alias-move record of `adapter`, in order: one search, paged."""
        records = []
        page_token = None
        with self.store.failing(f"read the alias history of {adapter!r}"):
            while True:
                page = self.store.client.search_model_versions(
                    f"name = '{adapter}'", page_token=page_token
                )
                for version in page:
                    records += records_in(version.tags or {})
                page_token = page.token
                if not page_token:
                    break
        return sorted(records, key=lambda record: record.move.number)


def check_activatable(registered: RegisteredRevision) -> None:
    """TransitionError unless `registered` is where activation can start: admitted, and not
    yet active."""
    if registered.stage not in ACTIVATABLE:
        raise TransitionError(
            f"{registered.id} is {registered.stage}; only an admitted revision can be "
            "activated: admit it first"
        )


def _intent_from(
    model: RegisteredModel | None, alias: str, revision: int | None, actor: str
) -> AliasIntent:
    """The intent of moving `model`'s `alias` from where it is now to `revision`."""
    before = (model.aliases or {}).get(alias) if model else None
    previous = int(before) if before is not None else None
    return AliasIntent(revision, previous, actor, now(), done=False)
