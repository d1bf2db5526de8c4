"""A canary in the registry: `adapter@canary` and, beside it, the share of `production`'s
requests workers send to it (a registered-model tag). Judging one is
`mint_core.planning.canary_judge`'s."""

import logging
from dataclasses import dataclass

from mlflow.entities.model_registry import RegisteredModel

from mint_core.errors import ConfigurationError
from mint_core.registry._mlflow import CANARY_PERCENT_TAG, MlflowStore
from mint_core.registry.aliases import Aliases
from mint_core.registry.slots import RolloutSlot
from mint_core.revisions import CANARY, PRODUCTION, RevisionId

log = logging.getLogger(__name__)


def check_canary_percent(percent: float) -> float:
    """`percent` if it is a share a canary can have: more than 0, at most 100."""
    if not 0 < percent <= 100:  # NaN fails too
        raise ConfigurationError(
            f"canary share {percent}% is not valid; give a percentage of production's "
            "requests above 0 and at most 100 (e.g. 10)"
        )
    return percent


def canary_percent(model: RegisteredModel) -> float | None:
    """The canary share recorded on `model`; None if none, or if it is not a valid share (set
    by hand in the MLflow UI): a share nobody set on purpose sends no requests anywhere."""
    raw = (model.tags or {}).get(CANARY_PERCENT_TAG)
    if raw is None:
        return None
    try:
        return check_canary_percent(float(raw))
    except (ValueError, ConfigurationError):
        log.warning(
            "ignoring %s=%r on %s: not a share in (0, 100]", CANARY_PERCENT_TAG, raw, model.name
        )
        return None


@dataclass(frozen=True)
class Canaries:
    """Starting, ending and reading an adapter's canary."""

    store: MlflowStore
    aliases: Aliases
    """What moves and drops `canary`, recording each move."""

    def start(
        self,
        revision: RevisionId,
        percent: float,
        actor: str = "mint",
        reason: str = "",
        *,
        slot: RolloutSlot,
    ) -> int | None:
        """Send `percent` of `adapter@production`'s requests to `revision` on every worker that
        has it ready: `adapter@canary` moves to it (recorded in the alias history) and the share
        is set beside it. The revision `canary` named before, if any. Workers follow at their
        next sync; a worker that does not have `revision` ready keeps serving production.
        `slot`: the adapter's roll-out slot, held (`Aliases.move`)."""
        check_canary_percent(percent)
        slot.check(revision.adapter)  # before the share, which must not go out without a move
        self.store.model(revision.adapter)
        with self.store.failing(f"set the canary share of {revision.adapter!r}"):
            # The share first: a worker that syncs in between sees it with the old canary, or
            # with none (no canary traffic), never a new canary at a stale share.
            self.store.client.set_registered_model_tag(
                revision.adapter, CANARY_PERCENT_TAG, str(float(percent))
            )
        return self.aliases.move(revision, CANARY, actor, reason, slot=slot)

    def end(
        self, adapter: str, actor: str = "mint", reason: str = "", *, slot: RolloutSlot
    ) -> RevisionId | None:
        """Stop sending `adapter@production`'s requests to a canary: the share is removed, the
        end is recorded in the alias history as a move of `canary` to the `production` revision
        with `reason` (the decision and its figures), and the alias is dropped. The revision the
        canary named; None, and nothing recorded, if there was no canary. Idempotent.
        `slot`: the adapter's roll-out slot, held (`Aliases.move`)."""
        slot.check(adapter)
        model = self.store.model(adapter)
        aliases = model.aliases or {}
        canary = aliases.get(CANARY)
        if CANARY_PERCENT_TAG in (model.tags or {}):
            with self.store.failing(f"remove the canary share of {adapter!r}"):
                self.store.client.delete_registered_model_tag(adapter, CANARY_PERCENT_TAG)
            if canary is None:
                self.aliases.touch(adapter, model)  # the moves below touch it otherwise
        if canary is None:
            return None
        # Without `production` the end is recorded on the canary revision itself.
        landing = int(aliases.get(PRODUCTION, canary))
        self.aliases.move(RevisionId(adapter, landing), CANARY, actor, reason, slot=slot)
        self.aliases.drop(adapter, CANARY)
        return RevisionId(adapter, int(canary))

    def current(self, adapter: str) -> tuple[RevisionId, float] | None:
        """The canary revision of `adapter` and its share in percent, as the registry has them
        now; None when there is no canary."""
        model = self.store.model(adapter)
        canary = (model.aliases or {}).get(CANARY)
        percent = canary_percent(model)
        if canary is None or percent is None:
            return None
        return RevisionId(adapter, int(canary)), percent
