"""The MLflow model registry as MinT's source of truth.

Registered model = adapter, model version = revision (`rN` is the version number), version tags
= policy record and stage, aliases = what users get. Registering writes metadata only: the
weights stay in the artifact store and the version's `source` points at them.
"""

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

from mlflow.entities.model_registry import ModelVersion, RegisteredModel
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from mint_core.errors import BaseMismatchError, NotFoundError, RegistryError
from mint_core.revisions import PRODUCTION, TAG_PREFIX, PolicyRecord, RevisionId, RevisionRef
from mint_core.states import Stage, transition

STAGE_TAG = TAG_PREFIX + "stage"
KIND_TAG = TAG_PREFIX + "kind"
ACTIVATED_AT_TAG = TAG_PREFIX + "activated_at"
STAGE_HISTORY_TAG = TAG_PREFIX + "stage_history"
ALIAS_HISTORY_TAG = TAG_PREFIX + "alias_history"
FAILURE_TAG = TAG_PREFIX + "failure_reason"
_ADAPTER_KIND = "adapter"
_EXPERIMENT = "mint-releases"
_POLICY_ARTIFACT = "policy.json"


@dataclass(frozen=True)
class AliasMove:
    """One move of an alias, as `mint history` lists it."""

    at: str
    """ISO-8601 UTC time of the move."""
    alias: str
    from_revision: int | None
    to_revision: int
    actor: str
    reason: str


@dataclass(frozen=True)
class AdapterAliases:
    """An adapter's aliases as of its last change in the registry."""

    adapter: str
    aliases: Mapping[str, int]
    """Alias -> revision number."""
    updated_ms: int
    """The registry's last-updated time of the adapter, in milliseconds (its clock)."""


@dataclass(frozen=True)
class RegisteredRevision:
    """A revision as the registry knows it."""

    id: RevisionId
    policy: PolicyRecord
    artifact_uri: str
    stage: Stage
    aliases: tuple[str, ...]
    tags: Mapping[str, str]


class Registry:
    """MinT's operations on an MLflow tracking server."""

    def __init__(self, tracking_uri: str) -> None:
        self.tracking_uri = tracking_uri
        self._client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)

    def register(
        self, policy: PolicyRecord, artifact_uri: str, serving_base_digest: str
    ) -> RegisteredRevision:
        """Create the next revision of `policy.adapter`. Nothing is written unless the policy's
        base matches the serving base and, if the adapter exists, the adapter's base."""
        if policy.base_digest != serving_base_digest:
            raise BaseMismatchError(
                f"adapter {policy.adapter!r} was trained on base {policy.base_digest} but the "
                f"serving base is {serving_base_digest}; retrain it on the serving base"
            )
        existing = self._registered_model(policy.adapter)
        if existing is not None:
            adapter_base = existing.tags.get(TAG_PREFIX + "base_digest")
            if adapter_base and adapter_base != policy.base_digest:
                raise BaseMismatchError(
                    f"adapter {policy.adapter!r} is registered on base {adapter_base}; this "
                    f"revision was trained on {policy.base_digest}"
                )
        try:
            run_id = self._log_release_run(policy)
            if existing is None:
                self._client.create_registered_model(
                    policy.adapter,
                    tags={KIND_TAG: _ADAPTER_KIND, TAG_PREFIX + "base_digest": policy.base_digest},
                    description=f"MinT adapter over base {policy.base_model_id}",
                )
            version = self._client.create_model_version(
                policy.adapter,
                source=artifact_uri,
                run_id=run_id,
                tags={**policy.to_tags(), STAGE_TAG: Stage.REGISTERED.value},
                description=f"{policy.task} adapter, content {policy.content_digest}",
            )
        except MlflowException as e:
            raise RegistryError(f"MLflow refused to register {policy.adapter!r}: {e}") from e
        return self._revision(version, aliases=())

    def _log_release_run(self, policy: PolicyRecord) -> str:
        """An MLflow run holding the policy record as a JSON artifact, linked from the version."""
        experiment = self._client.get_experiment_by_name(_EXPERIMENT)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self._client.create_experiment(_EXPERIMENT)
        )
        run = self._client.create_run(
            experiment_id,
            run_name=f"{policy.adapter}-{policy.content_digest[7:19]}",
            tags={TAG_PREFIX + "adapter": policy.adapter},
        )
        run_id = run.info.run_id
        self._client.log_text(run_id, policy.to_json(), _POLICY_ARTIFACT)
        for name, value in policy.eval_metrics.items():
            self._client.log_metric(run_id, name, value, step=policy.training_steps)
        self._client.set_terminated(run_id)
        return run_id

    def resolve(self, ref: RevisionRef) -> RegisteredRevision:
        """The revision `ref` names now. NotFoundError names the adapter, alias or revision."""
        if self._registered_model(ref.adapter) is None:
            raise NotFoundError(f"adapter {ref.adapter!r} is not registered")
        try:
            if ref.revision is not None:
                version = self._client.get_model_version(ref.adapter, str(ref.revision))
            else:
                version = self._client.get_model_version_by_alias(ref.adapter, str(ref.alias))
        except MlflowException as e:
            if e.error_code == "RESOURCE_DOES_NOT_EXIST" or "not found" in str(e).lower():
                raise NotFoundError(f"{ref} does not exist in the registry") from None
            raise RegistryError(f"MLflow failed to resolve {ref}: {e}") from e
        except OSError as e:  # the server does not answer
            raise RegistryError(f"MLflow at {self.tracking_uri} cannot resolve {ref}: {e}") from e
        return self._revision(version, aliases=tuple(version.aliases or ()))

    def get(self, revision: RevisionId) -> RegisteredRevision:
        return self.resolve(RevisionRef(revision.adapter, revision=revision.number))

    def set_stage(
        self, revision: RevisionId, stage: Stage, actor: str = "mint", reason: str = ""
    ) -> None:
        """Move a revision's recorded stage, refusing moves the stage table forbids, and append
        the move to the revision's stage history (shown by the MLflow UI as a tag)."""
        registered = self.get(revision)
        transition(registered.stage, stage)
        history = json.loads(registered.tags.get(STAGE_HISTORY_TAG, "[]"))
        history.append(
            {"at": _now(), "from": registered.stage.value, "to": stage.value, "actor": actor,
             "reason": reason}
        )  # fmt: skip
        version = str(revision.number)
        self._client.set_model_version_tag(revision.adapter, version, STAGE_TAG, stage.value)
        self._client.set_model_version_tag(
            revision.adapter, version, STAGE_HISTORY_TAG, json.dumps(history)
        )

    def stage_history(self, revision: RevisionId) -> list[dict[str, str]]:
        return json.loads(self.get(revision).tags.get(STAGE_HISTORY_TAG, "[]"))

    def mark_failed(self, revision: RevisionId, reason: str, actor: str = "mint") -> None:
        """Record that a pipeline step failed for `revision`, and why."""
        self.set_stage(revision, Stage.FAILED, actor, reason[:4000])
        self._client.set_model_version_tag(
            revision.adapter, str(revision.number), FAILURE_TAG, reason[:4000]
        )

    def move_alias(
        self, revision: RevisionId, alias: str, actor: str = "mint", reason: str = ""
    ) -> int | None:
        """Point `adapter@alias` at `revision`, record the move in the adapter's alias history,
        and return the revision the alias pointed at before."""
        try:
            previous = self._client.get_model_version_by_alias(revision.adapter, alias)
            previous_number: int | None = int(previous.version)
        except MlflowException:
            previous_number = None
        self.point_alias(revision, alias)
        now = _now()
        self._client.set_model_version_tag(
            revision.adapter, str(revision.number), ACTIVATED_AT_TAG, now
        )
        moves = [asdict(move) for move in self.alias_history(revision.adapter)]
        moves.append(asdict(AliasMove(now, alias, previous_number, revision.number, actor, reason)))
        self._client.set_registered_model_tag(
            revision.adapter, ALIAS_HISTORY_TAG, json.dumps(moves)
        )
        return previous_number

    def point_alias(self, revision: RevisionId, alias: str) -> None:
        """Set `adapter@alias` to `revision` with no history: for working aliases such as
        `candidate`. Workers see the change at their next sync."""
        self._client.set_registered_model_alias(revision.adapter, alias, str(revision.number))
        self._touch(revision.adapter)

    def drop_alias(self, adapter: str, alias: str) -> None:
        """Remove `adapter@alias` (nothing happens if it does not exist)."""
        try:
            self._client.delete_registered_model_alias(adapter, alias)
        except MlflowException as e:
            if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise RegistryError(f"MLflow failed to remove {adapter}@{alias}: {e}") from e
        self._touch(adapter)

    def _touch(self, adapter: str) -> None:
        # MLflow does not count an alias or tag change as an update of the registered model;
        # re-setting its description does, and workers find changes by that time.
        model = self._registered_model(adapter)
        self._client.update_registered_model(
            adapter, description=model.description if model else ""
        )

    def adapters_changed_since(self, since_ms: int, page_size: int = 20) -> list[AdapterAliases]:
        """Every adapter updated (new revision, alias moved) at or after `since_ms` on the
        registry's clock, newest first: what a worker needs to catch up. Pages are small, as a
        sync usually finds a few changes at most. RegistryError if MLflow cannot answer."""
        changed: list[AdapterAliases] = []
        page_token = None
        try:
            while True:
                page = self._client.search_registered_models(
                    max_results=page_size,
                    order_by=["last_updated_timestamp DESC"],
                    page_token=page_token,
                )
                for model in page:
                    if model.last_updated_timestamp < since_ms:
                        return changed
                    if model.tags.get(KIND_TAG) == _ADAPTER_KIND:
                        aliases = {a: int(v) for a, v in (model.aliases or {}).items()}
                        changed.append(
                            AdapterAliases(model.name, aliases, model.last_updated_timestamp)
                        )
                page_token = page.token
                if not page_token:
                    return changed
        except (MlflowException, OSError) as e:  # OSError: the server does not answer
            raise RegistryError(f"MLflow at {self.tracking_uri} cannot list adapters: {e}") from e

    def alias_history(self, adapter: str) -> list[AliasMove]:
        """Every alias move of `adapter`, oldest first."""
        model = self._registered_model(adapter)
        if model is None:
            raise NotFoundError(f"adapter {adapter!r} is not registered")
        return [AliasMove(**move) for move in json.loads(model.tags.get(ALIAS_HISTORY_TAG, "[]"))]

    def previous(self, adapter: str, alias: str = PRODUCTION) -> RevisionId:
        """The revision `alias` pointed at before its current one: what a rollback returns to."""
        current = self.resolve(RevisionRef(adapter, alias=alias)).id.number
        for move in reversed(self.alias_history(adapter)):
            if move.alias != alias or move.to_revision != current:
                continue
            if move.from_revision is not None and move.from_revision != current:
                return RevisionId(adapter, move.from_revision)
            break
        raise NotFoundError(
            f"{adapter}@{alias} has no earlier revision to roll back to; name one with "
            "--to-revision"
        )

    def has_adapter(self, adapter: str) -> bool:
        return self._registered_model(adapter) is not None

    def adapters(self) -> list[str]:
        models = self._client.search_registered_models(
            filter_string=f"tags.`{KIND_TAG}` = '{_ADAPTER_KIND}'"
        )
        return sorted(model.name for model in models)

    def revisions(self, adapter: str) -> list[RegisteredRevision]:
        """Every revision of `adapter`, oldest first, with its aliases."""
        model = self._registered_model(adapter)
        if model is None:
            raise NotFoundError(f"adapter {adapter!r} is not registered")
        aliases: dict[str, list[str]] = {}
        for alias, version in (model.aliases or {}).items():
            aliases.setdefault(str(version), []).append(alias)
        versions = self._client.search_model_versions(f"name = '{adapter}'")
        revisions = [
            self._revision(v, tuple(sorted(aliases.get(str(v.version), [])))) for v in versions
        ]
        return sorted(revisions, key=lambda r: r.id.number)

    def _registered_model(self, adapter: str) -> RegisteredModel | None:
        try:
            return self._client.get_registered_model(adapter)
        except MlflowException as e:
            if e.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise RegistryError(f"MLflow failed to look up adapter {adapter!r}: {e}") from e
        except OSError as e:  # the server does not answer
            raise RegistryError(f"MLflow at {self.tracking_uri} does not answer: {e}") from e

    def _revision(self, version: ModelVersion, aliases: tuple[str, ...]) -> RegisteredRevision:
        tags = dict(version.tags or {})
        return RegisteredRevision(
            id=RevisionId(version.name, int(version.version)),
            policy=PolicyRecord.from_tags(tags),
            artifact_uri=version.source,
            stage=Stage(tags.get(STAGE_TAG, Stage.REGISTERED.value)),
            aliases=aliases,
            tags=tags,
        )


def _now() -> str:
    return datetime.now(UTC).isoformat()
