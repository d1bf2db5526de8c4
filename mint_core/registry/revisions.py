"""Revisions in the registry: registering one (a model version whose tags are its policy
record), resolving a name to one, and listing them."""

import contextlib
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Self

from mlflow.entities.model_registry import ModelVersion, RegisteredModel
from mlflow.exceptions import MlflowException

from mint_core.errors import BaseMismatchError, ConfigurationError, NotFoundError, RegistryError
from mint_core.history import version_description
from mint_core.registry._mlflow import (
    ADAPTER_KIND,
    BASE_DIGEST_TAG,
    KIND_TAG,
    STAGE_HISTORY_TAG,
    STAGE_TAG,
    MlflowStore,
    missing,
)
from mint_core.registry.grants import Grants
from mint_core.registry.runs import Runs
from mint_core.registry.stage_log import StageMark, first_history
from mint_core.revisions import PRODUCTION, TAG_PREFIX, PolicyRecord, RevisionId, RevisionRef
from mint_core.states import Stage

log = logging.getLogger(__name__)

SHOWN_REVISIONS = 10
"""Revisions a "not found" message lists one by one; more are given as a count and a range."""
VERSIONS_PAGE = 1000
"""Model versions per page when reading every revision: a few MB of JSON per request. (MLflow
accepts up to 200,000; larger pages were no faster.)"""


@dataclass(frozen=True)
class RegisteredRevision:
    """A revision as the registry knows it."""

    id: RevisionId
    policy: PolicyRecord
    artifact_uri: str
    stage: Stage
    aliases: tuple[str, ...]
    tags: Mapping[str, str]
    description: str = ""
    """The model version's description: its own text, then its history table (`history`)."""

    @classmethod
    def from_tags(
        cls,
        id: RevisionId,
        artifact_uri: str,
        tags: Mapping[str, str],
        aliases: tuple[str, ...] = (),
        description: str = "",
        policy: PolicyRecord | None = None,
    ) -> Self:
        """The revision its model-version tags describe: its stage, and its policy record
        unless `policy` gives it (the catalog index keeps the record apart from the tags)."""
        return cls(
            id=id,
            policy=PolicyRecord.from_tags(tags) if policy is None else policy,
            artifact_uri=artifact_uri,
            stage=Stage(tags.get(STAGE_TAG, Stage.REGISTERED.value)),
            aliases=aliases,
            tags=dict(tags),
            description=description,
        )

    @classmethod
    def from_version(cls, version: ModelVersion, aliases: tuple[str, ...]) -> Self:
        return cls.from_tags(
            RevisionId(version.name, int(version.version)),
            version.source,
            version.tags or {},
            aliases,
            version.description or "",
        )

    def check_promotable(self) -> None:
        """ConfigurationError if it already is what `production` serves: a promote or
        rollback to it would change nothing. Checked by the CLI before anything starts, and by
        the flows (a UI run starts none of the CLI's checks)."""
        if self.stage is Stage.ACTIVE and PRODUCTION in self.aliases:
            raise ConfigurationError(
                f"{self.id} is already {self.id.adapter}@{PRODUCTION}; if workers cannot load "
                f"it (a damaged artifact), repair it: mint repair --adapter {self.id.adapter} "
                f"--revision {self.id.number}"
            )


@dataclass(frozen=True)
class Revisions:
    """Registering, resolving and listing revisions."""

    store: MlflowStore
    runs: Runs
    """Where a revision's policy record is kept (`register`)."""
    grants: Grants
    """Who else may write an existing adapter (`register` refuses one others may change)."""

    def register(
        self,
        policy: PolicyRecord,
        artifact_uri: str,
        serving_base_digest: str,
        run_id: str | None = None,
        tags: Mapping[str, str] | None = None,
        reached: Sequence[StageMark] = (),
    ) -> RegisteredRevision:
        """Create the next revision of `policy.adapter`, linked to its training run `run_id`
        (`Runs.start_training`; a run is made for an imported adapter), with `tags` beside its
        policy record. Its stage history starts with the pipeline's steps `reached` before
        (trained, frozen, packed, exported, with their times), then `registered`, all as
        `policy.created_by`'s, written with the version. Nothing is written unless the
        policy's base matches the serving base and, if the adapter exists, the adapter's base
        and only the pipeline and admins may write it (`Grants.check_only_pipeline_writes`).
        An adapter whose registered model was made outside MinT (MLflow's UI, another client)
        becomes MinT's: its kind and base tags are written before the version, so the fleet's
        syncs follow it (`changes`).

        The model version is created whole, every tag with it, in one request: it is the step
        that makes the revision exist, so a registration that fails or is killed leaves either
        no revision or a complete one. MLflow requests: 4 for a trained adapter (look up the
        adapter, write the policy artifact, create the version, name the run), 6 for an
        imported one (create its run, end it), one more for a new adapter or for reading who may
        write an existing one (two, the first time an adapter made outside MinT is tagged), and
        one more for the first import in a process (the experiment's id); a training run whose
        artifact location this process does not know yet costs MLflow's client one read of it."""
        if policy.base_digest != serving_base_digest:
            raise BaseMismatchError(
                f"adapter {policy.adapter!r} was trained on base {policy.base_digest} but the "
                f"serving base is {serving_base_digest}; retrain it on the serving base"
            )
        existing = self.store.model_or_none(policy.adapter)
        if existing is not None:
            adapter_base = existing.tags.get(BASE_DIGEST_TAG)
            if adapter_base and adapter_base != policy.base_digest:
                raise BaseMismatchError(
                    f"adapter {policy.adapter!r} is registered on base {adapter_base}; this "
                    f"revision was trained on {policy.base_digest}"
                )
            self.grants.check_only_pipeline_writes(policy.adapter)
        history = first_history(reached, policy.created_by)
        tags = {**(tags or {}), STAGE_HISTORY_TAG: json.dumps(history)}
        imported = run_id is None
        with self.store.failing(f"register {policy.adapter!r}"):
            run_id = self.runs.start_release(policy, run_id)
            try:
                version = self._create_version(policy, artifact_uri, run_id, existing, tags)
            except Exception:
                if imported:  # its run made nothing: say so rather than leave it running
                    with contextlib.suppress(MlflowException, RegistryError):
                        self.store.end_run(run_id, "FAILED")
                raise
            revision = str(RevisionId(policy.adapter, int(version.version)))
            self.runs.finish_release(run_id, policy, revision, imported)
        return RegisteredRevision.from_version(version, aliases=())

    def _create_version(
        self,
        policy: PolicyRecord,
        artifact_uri: str,
        run_id: str,
        existing: RegisteredModel | None,
        tags: Mapping[str, str],
    ) -> ModelVersion:
        """The model version of a new revision (and its registered model, for a new adapter),
        its history table written from the stage history in `tags`."""
        # MLflow keeps registered-model tag values in String(5000), which PostgreSQL enforces:
        # MinT's are a word and the serving base's sha256 digest, and history goes to
        # model-version tags (Text).
        adapter_tags = {KIND_TAG: ADAPTER_KIND, BASE_DIGEST_TAG: policy.base_digest}
        if existing is None:
            self.store.client.create_registered_model(
                policy.adapter,
                tags=adapter_tags,
                description=f"MinT adapter over base {policy.base_model_id}",
            )
        else:
            # Made outside MinT: untagged, the fleet's change feed would skip it for good.
            for key, value in adapter_tags.items():
                if existing.tags.get(key) != value:
                    self.store.client.set_registered_model_tag(policy.adapter, key, value)
        return self.store.client.create_model_version(
            policy.adapter,
            source=artifact_uri,
            run_id=run_id,
            tags={**tags, **policy.to_tags(), STAGE_TAG: Stage.REGISTERED.value},
            description=version_description(
                f"trained on {policy.dataset or 'data from elsewhere (imported)'}, "
                f"content {policy.content_digest}",
                json.loads(tags.get(STAGE_HISTORY_TAG, "[]")),
                [],
            ),
        )

    def resolve(self, ref: RevisionRef) -> RegisteredRevision:
        """The revision `ref` names now. NotFoundError names the adapter, alias or revision."""
        with self.store.failing(f"resolve {ref}"):
            try:
                if ref.revision is not None:
                    version = self.store.client.get_model_version(ref.adapter, str(ref.revision))
                else:
                    version = self.store.client.get_model_version_by_alias(
                        ref.adapter, str(ref.alias)
                    )
            except MlflowException as e:
                # One request when it exists; when not, more say what is missing: the adapter,
                # or the revision or alias of a registered one (and which revisions it has).
                self.store.model(ref.adapter)
                if missing(e) or "not found" in str(e).lower():
                    raise NotFoundError(self._missing(ref)) from None
                raise
        return RegisteredRevision.from_version(version, aliases=tuple(version.aliases or ()))

    def _missing(self, ref: RevisionRef) -> str:
        """Why `ref`, of a registered adapter, names nothing, with the revisions it has: an
        adapter registered but never released has no `production` yet, which is not the same
        as not existing."""
        versions = self.store.client.search_model_versions(f"name = '{ref.adapter}'")
        numbers = sorted(int(version.version) for version in versions)
        if not numbers:
            registered = "no revision registered"
        elif len(numbers) <= SHOWN_REVISIONS:
            registered = "registered: " + ", ".join(f"r{n}" for n in numbers)
        else:
            registered = f"registered: {len(numbers)} revisions, r{numbers[0]} to r{numbers[-1]}"
        if ref.revision is not None:
            return f"{ref} does not exist in the registry ({registered})"
        what = f"{ref.adapter} has no {ref.alias} revision yet ({registered})"
        if not numbers:
            return what
        newest = f"{ref.adapter}:r{numbers[-1]}"
        if ref.alias != PRODUCTION:
            return f"{what}; ask for a revision by number, e.g. {newest}"
        promote = f"mint promote --adapter {ref.adapter} --revision {numbers[-1]}"
        return f"{what}; promote one (`{promote}`) or ask for it by number, e.g. {newest}"

    def get(self, revision: RevisionId) -> RegisteredRevision:
        return self.resolve(RevisionRef(revision.adapter, revision=revision.number))

    def set_tag(self, revision: RevisionId, key: str, value: str) -> None:
        with self.store.failing(f"tag {revision} with {key}"):
            self.store.client.set_model_version_tag(
                revision.adapter, str(revision.number), key, value
            )

    def has_adapter(self, adapter: str) -> bool:
        return self.store.model_or_none(adapter) is not None

    def adapters(self) -> list[str]:
        models = self.store.client.search_registered_models(
            filter_string=f"tags.`{KIND_TAG}` = '{ADAPTER_KIND}'"
        )
        return sorted(model.name for model in models)

    def of(self, adapter: str) -> list[RegisteredRevision]:
        """Every revision of `adapter`, oldest first, with its aliases."""
        model = self.store.model(adapter)
        aliases: dict[str, list[str]] = {}
        for alias, version in (model.aliases or {}).items():
            aliases.setdefault(str(version), []).append(alias)
        versions = self.store.client.search_model_versions(f"name = '{adapter}'")
        revisions = [
            RegisteredRevision.from_version(v, tuple(sorted(aliases.get(str(v.version), []))))
            for v in versions
        ]
        return sorted(revisions, key=lambda r: r.id.number)

    def pages(self, page_size: int = VERSIONS_PAGE) -> Iterator[list[RegisteredRevision]]:
        """Every revision of every adapter, a page at a time, in name and number order: what a
        catalog is built from. Versions that carry no policy record (models that are not MinT
        adapters) are left out. A revision registered while this runs may be missed: a catalog
        asks for one it lacks when it is named. RegistryError if MLflow cannot answer."""
        page_token = None
        while True:
            with self.store.failing("list every revision"):
                page = self.store.client.search_model_versions(
                    max_results=page_size,
                    order_by=["name ASC", "version_number ASC"],
                    page_token=page_token,
                )
            revisions = []
            for version in page:
                if (version.tags or {}).get(TAG_PREFIX + "content_digest") is None:
                    continue
                aliases = tuple(sorted(version.aliases or ()))
                try:
                    revisions.append(RegisteredRevision.from_version(version, aliases))
                except ConfigurationError as e:  # asked for by name, it fails there, as today
                    log.warning(
                        "left %s:r%s out of the catalog: %s", version.name, version.version, e
                    )
            yield revisions
            page_token = page.token
            if not page_token:
                return
