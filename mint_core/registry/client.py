"""`Registry`: one MLflow store and the parts that work through it, each a field.

Like MLflow's own client, which hands each call to its registry client and that to its store:
a part gets the store and the parts it uses in its constructor and reaches no other, so what
an alias move does is read in `Aliases`, not found along an inheritance order."""

from collections.abc import Callable, Iterator, Mapping, Sequence

from mint_core.gates import Gates
from mint_core.registry._mlflow import MlflowStore
from mint_core.registry.aliases import Aliases
from mint_core.registry.canary import Canaries
from mint_core.registry.changes import AdapterAliases, Changes
from mint_core.registry.gates import AdapterGates
from mint_core.registry.moves import AliasMove
from mint_core.registry.revisions import VERSIONS_PAGE, RegisteredRevision, Revisions
from mint_core.registry.runs import DatasetLog, Runs
from mint_core.registry.slots import RolloutSlot
from mint_core.registry.stage_log import StageMark
from mint_core.registry.stages import Stages
from mint_core.revisions import PRODUCTION, PolicyRecord, RevisionId, RevisionRef
from mint_core.states import Stage


class Registry:
    """MinT's operations on an MLflow tracking server, a part per field.

    The methods below are one-line forwarders to the parts, kept while callers move to the
    fields (`registry.aliases.move(...)`); new code calls the fields."""

    store: MlflowStore
    """The client (read by every part at every call) and its lookups."""
    runs: Runs
    revisions: Revisions
    stages: Stages
    aliases: Aliases
    canary: Canaries
    gates: AdapterGates
    changes: Changes

    def __init__(self, tracking_uri: str) -> None:
        self.store = MlflowStore(tracking_uri)
        self.runs = Runs(self.store)
        self.revisions = Revisions(self.store, self.runs)
        self.stages = Stages(self.store, self.revisions)
        self.aliases = Aliases(self.store, self.revisions, self.stages)
        self.canary = Canaries(self.store, self.aliases)
        self.gates = AdapterGates(self.store)
        self.changes = Changes(self.store)

    @property
    def tracking_uri(self) -> str:
        return self.store.tracking_uri

    # Forwarders (see the class docstring).

    def start_training_run(
        self, adapter: str, params: Mapping[str, str], dataset: DatasetLog
    ) -> str:
        return self.runs.start_training(adapter, params, dataset)

    def log_params(self, run_id: str, params: Mapping[str, str]) -> None:
        self.runs.log_params(run_id, params)

    def log_losses(self, run_id: str, name: str, losses: Sequence[tuple[int, float]]) -> None:
        self.runs.log_losses(run_id, name, losses)

    def log_metrics(self, run_id: str, step: int, metrics: Mapping[str, float]) -> None:
        self.runs.log_metrics(run_id, step, metrics)

    def finish_training_run(
        self, run_id: str, metrics: Mapping[str, float], step: int, failed: bool = False
    ) -> None:
        self.runs.finish_training(run_id, metrics, step, failed)

    def register(
        self,
        policy: PolicyRecord,
        artifact_uri: str,
        serving_base_digest: str,
        run_id: str | None = None,
        tags: Mapping[str, str] | None = None,
        reached: Sequence[StageMark] = (),
    ) -> RegisteredRevision:
        return self.revisions.register(
            policy, artifact_uri, serving_base_digest, run_id, tags, reached
        )

    def resolve(self, ref: RevisionRef) -> RegisteredRevision:
        return self.revisions.resolve(ref)

    def get(self, revision: RevisionId) -> RegisteredRevision:
        return self.revisions.get(revision)

    def set_revision_tag(self, revision: RevisionId, key: str, value: str) -> None:
        self.revisions.set_tag(revision, key, value)

    def has_adapter(self, adapter: str) -> bool:
        return self.revisions.has_adapter(adapter)

    def adapters(self) -> list[str]:
        return self.revisions.adapters()

    def all_revisions(self, page_size: int = VERSIONS_PAGE) -> Iterator[list[RegisteredRevision]]:
        return self.revisions.pages(page_size)

    def set_stage(
        self,
        revision: RevisionId | RegisteredRevision,
        stage: Stage,
        actor: str = "mint",
        reason: str = "",
    ) -> RegisteredRevision:
        return self.stages.set(revision, stage, actor, reason)

    def walk_stages(
        self,
        revision: RevisionId | RegisteredRevision,
        stages: Sequence[Stage],
        actor: str = "mint",
        reason: str = "",
    ) -> RegisteredRevision:
        return self.stages.walk(revision, stages, actor, reason)

    def note_stage(self, revision: RevisionId, actor: str, reason: str, approver: str = "") -> None:
        self.stages.note(revision, actor, reason, approver)

    def stage_history(self, revision: RevisionId) -> list[dict[str, str]]:
        return self.stages.history(revision)

    def mark_failed(self, revision: RevisionId, reason: str, actor: str = "mint") -> None:
        self.stages.mark_failed(revision, reason, actor)

    def move_alias(
        self,
        revision: RevisionId,
        alias: str,
        actor: str = "mint",
        reason: str = "",
        approver: str = "",
        *,
        slot: RolloutSlot,
    ) -> int | None:
        return self.aliases.move(revision, alias, actor, reason, approver, slot=slot)

    def point_alias(self, revision: RevisionId, alias: str, actor: str = "mint") -> None:
        self.aliases.point(revision, alias, actor)

    def drop_alias(self, adapter: str, alias: str, actor: str = "mint") -> None:
        self.aliases.drop(adapter, alias, actor)

    def reject(self, revision: RevisionId, actor: str, reason: str) -> None:
        self.aliases.reject(revision, actor, reason)

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
        return self.aliases.activate(registered, alias, actor, reason, approver, moved, slot=slot)

    def alias_history(self, adapter: str) -> list[AliasMove]:
        return self.aliases.history(adapter)

    def previous(self, adapter: str, alias: str = PRODUCTION) -> RevisionId:
        return self.aliases.previous(adapter, alias)

    def start_canary(
        self,
        revision: RevisionId,
        percent: float,
        actor: str = "mint",
        reason: str = "",
        *,
        slot: RolloutSlot,
    ) -> int | None:
        return self.canary.start(revision, percent, actor, reason, slot=slot)

    def end_canary(
        self, adapter: str, actor: str = "mint", reason: str = "", *, slot: RolloutSlot
    ) -> RevisionId | None:
        return self.canary.end(adapter, actor, reason, slot=slot)

    def set_gates(self, adapter: str, gates: Gates) -> None:
        self.gates.set(adapter, gates)

    def adapters_changed_since(self, since_ms: int, page_size: int = 20) -> list[AdapterAliases]:
        return self.changes.since(since_ms, page_size)
