"""The MLflow model registry as MinT's source of truth.

Registered model = adapter, model version = revision (`rN` is the version number), version tags
= policy record and stage, aliases = what users get. Registering writes metadata only: the
weights stay in the artifact store and the version's `source` points at them.
"""

import functools
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

import requests
from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param
from mlflow.entities.model_registry import ModelVersion, RegisteredModel
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from mint_core.alias_intents import INTENT_TAG, AliasIntent, HeldMove, intents_of, sanctioned
from mint_core.errors import BaseMismatchError, ConfigurationError, NotFoundError, RegistryError
from mint_core.gates import GATES_TAG, Gates
from mint_core.history import adapter_description, version_description
from mint_core.revisions import (
    CANARY,
    CANDIDATE,
    POLICY_FILE,
    PRODUCTION,
    TAG_PREFIX,
    PolicyRecord,
    RevisionId,
    RevisionRef,
)
from mint_core.states import Stage, transition

log = logging.getLogger(__name__)

STAGE_TAG = TAG_PREFIX + "stage"
KIND_TAG = TAG_PREFIX + "kind"
ACTIVATED_AT_TAG = TAG_PREFIX + "activated_at"
STAGE_HISTORY_TAG = TAG_PREFIX + "stage_history"
"""A revision's stage moves, one JSON list in one model-version tag. Model-version tag values are
`Text` in MLflow's schema, and MLflow accepts up to 100,000 characters: with reasons cut to
`_REASON_CHARS`, that is well over a hundred moves of one revision (a roll-out is four)."""
ALIAS_MOVE_TAG = TAG_PREFIX + "alias_move."
"""Prefix of the tags recording alias moves, one small tag per move on the version moved to:
`mint.alias_move.000042` is the adapter's 42nd move. History grows without bound and no tag
does; registered-model tags, which every worker sync reads, hold none of it."""
FAILURE_TAG = TAG_PREFIX + "failure_reason"
APPROVAL_RUN_TAG = TAG_PREFIX + "approval_run"
"""The Prefect flow run paused for a revision's approval: what `mint approve` resumes."""
CANARY_PERCENT_TAG = TAG_PREFIX + "canary_percent"
"""The share, in percent, of `name@production` requests that workers send to `name@canary`: a
registered-model tag, so that every worker reads the same share at the same sync as the alias."""
_REASON_CHARS = 1000
"""Reasons are cut to this length in history records, keeping each one small."""
MODELS_PAGE_MAX = 1000
"""The most registered models MLflow's server returns per page (its `search_registered_models`
refuses more)."""
VERSIONS_PAGE = 1000
"""Model versions per page when reading every revision: a few MB of JSON per request. (MLflow
accepts up to 200,000; larger pages were no faster.)"""
_ADAPTER_KIND = "adapter"
_EXPERIMENT = "mint-releases"
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
"""The tag MLflow's UI reads to open an experiment as model training (runs, the model registry
in its sidebar) rather than as GenAI development (an empty traces page)."""
MODEL_DEVELOPMENT = "custom_model_development"
REVISION_RUN_TAG = TAG_PREFIX + "revision"
"""On a training (or import) run: the revision it made, e.g. `upper-bot:r2`."""
RUN_NAME_TAG = "mlflow.runName"


@dataclass(frozen=True)
class DatasetLog:
    """A training dataset as an MLflow run records it."""

    source: str
    """Its path or URI."""
    digest: str
    """sha256 of its bytes."""
    rows: int
    local_path: Path | None = None
    """The file, when it is local: logged as an artifact of the run."""

    def input(self) -> DatasetInput:
        name = self.source.rstrip("/").rsplit("/", 1)[-1]
        source_type = "s3" if self.source.startswith("s3://") else "local"
        dataset = Dataset(
            name=name,
            digest=self.digest.removeprefix("sha256:")[:36],
            source_type=source_type,
            source=json.dumps({"uri": self.source}),
            profile=json.dumps({"num_rows": self.rows, "sha256": self.digest}),
        )
        return DatasetInput(dataset, [InputTag("mlflow.data.context", "training")])


@dataclass(frozen=True)
class AliasMove:
    """One move of an alias, as `mint history` lists it."""

    number: int
    """Its place among every alias move of the adapter, from 1."""
    at: str
    """ISO-8601 UTC time of the move."""
    alias: str
    from_revision: int | None
    to_revision: int
    actor: str
    reason: str
    approver: str = ""
    """Who approved the roll-out this move made, when its adapter's gates asked for one."""

    @property
    def tag(self) -> str:
        return f"{ALIAS_MOVE_TAG}{self.number:06d}"


@dataclass(frozen=True)
class _MoveRecord:
    """An alias move as its history tag holds it: written as an intent before the alias moves,
    marked done after."""

    move: AliasMove
    done: bool

    def to_tag(self) -> str:
        return json.dumps({**asdict(self.move), "done": self.done})

    @classmethod
    def from_tag(cls, value: str) -> "_MoveRecord":
        fields = json.loads(value)
        done = fields.pop("done")
        return cls(AliasMove(**fields), done)


def _moves_made(records: Sequence[_MoveRecord], aliases: Mapping[str, int]) -> list[AliasMove]:
    """The moves that happened, in order, from every history record (in order) and where the
    aliases point now. A record marked done happened, whatever moved the alias since (the MLflow
    UI can). One still an intent happened if its alias was next seen at its target: the next
    move of that alias started from there or, if none came after, the alias points there now.
    Otherwise its mover stopped before moving the alias."""
    made = []
    for position, record in enumerate(records):
        move = record.move
        if not record.done:
            later = (r.move for r in records[position + 1 :] if r.move.alias == move.alias)
            next_move = next(later, None)
            seen = next_move.from_revision if next_move else aliases.get(move.alias)
            if seen != move.to_revision:
                continue
        made.append(move)
    return made


@dataclass(frozen=True)
class AdapterAliases:
    """An adapter's aliases as of its last change in the registry."""

    adapter: str
    aliases: Mapping[str, int]
    """Alias -> revision number."""
    updated_ms: int
    """The registry's last-updated time of the adapter, in milliseconds (its clock)."""
    base_digest: str = ""
    """The base every revision of the adapter was trained on."""
    canary_percent: float | None = None
    """The share of `production`'s requests sent to the `canary` revision; None: no canary."""
    intents: Mapping[str, AliasIntent] = field(default_factory=dict)
    """Alias -> the pipeline's last move of it."""

    def sanctioned(self) -> tuple[dict[str, int], list[HeldMove]]:
        """The aliases workers serve (those the pipeline moved) and the held moves."""
        return sanctioned(self.adapter, self.aliases, self.intents)


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


class _Answering:
    """MLflow's client, except that a call the server does not answer (refused, timed out,
    failing after MLflow's retries) raises RegistryError naming the server, the setting that
    names it and the cause, whichever call it was. Other failures stay MLflow's own."""

    def __init__(self, tracking_uri: str) -> None:
        self._uri = tracking_uri
        self._client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)

    def __getattr__(self, name: str) -> object:
        method = getattr(self._client, name)
        if not callable(method):
            return method

        @functools.wraps(method)
        def call(*args: object, **kwargs: object) -> object:
            try:
                return method(*args, **kwargs)
            except (MlflowException, requests.RequestException) as e:
                cause = _unanswered(e)
                if cause is None:
                    raise
                raise RegistryError(
                    f"MLflow at {self._uri} (MLFLOW_TRACKING_URI) did not answer {name}: "
                    f"{cause}; check that it runs (`mint registry` starts one) and that "
                    "MLFLOW_TRACKING_URI points at it"
                ) from e

        return call


_UNANSWERED = (
    requests.exceptions.ConnectionError,
    requests.exceptions.Timeout,
    requests.exceptions.RetryError,
)
"""requests' errors for a server that does not answer, or answers only with errors until
MLflow's retries give up."""


def _unanswered(error: BaseException) -> str | None:
    """The innermost cause, as text, when `error` means the server did not answer; else None.
    MLflow's client turns requests' network errors into MlflowException, keeping the original
    as its context."""
    network = error if isinstance(error, requests.RequestException) else error.__context__
    if not isinstance(network, _UNANSWERED):
        return None
    cause: BaseException = network
    while (inner := cause.__cause__ or cause.__context__) is not None:
        cause = inner
    return str(cause) or type(cause).__name__


class Registry:
    """MinT's operations on an MLflow tracking server."""

    def __init__(self, tracking_uri: str) -> None:
        self.tracking_uri = tracking_uri
        # Typed as the client it stands in for: every call goes through it unchanged.
        self._client: MlflowClient = _Answering(tracking_uri)  # type: ignore[assignment]

    def register(
        self,
        policy: PolicyRecord,
        artifact_uri: str,
        serving_base_digest: str,
        run_id: str | None = None,
    ) -> RegisteredRevision:
        """Create the next revision of `policy.adapter`, linked to its training run `run_id`
        (`start_training_run`; a run is made for an imported adapter). Nothing is written
        unless the policy's base matches the serving base and, if the adapter exists, the
        adapter's base."""
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
            run_id = self._log_release_run(policy, run_id)
            if existing is None:
                # MLflow keeps registered-model tag values in String(5000), which PostgreSQL
                # enforces: MinT's are a word and the serving base's sha256 digest, and history
                # goes to model-version tags (Text).
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
                description=version_description(
                    f"trained on {policy.dataset or 'data from elsewhere (imported)'}, "
                    f"content {policy.content_digest}",
                    [],
                    [],
                ),
            )
            # The revision's number exists only now: the run is named after it, so the
            # experiment's runs list reads `upper-bot:r2`, not one name for every revision.
            revision = str(RevisionId(policy.adapter, int(version.version)))
            self._client.set_tag(run_id, RUN_NAME_TAG, revision)
            self._client.set_tag(run_id, REVISION_RUN_TAG, revision)
        except MlflowException as e:
            raise RegistryError(f"MLflow refused to register {policy.adapter!r}: {e}") from e
        return self._revision(version, aliases=())

    def _experiment_id(self) -> str:
        experiment = self._client.get_experiment_by_name(_EXPERIMENT)
        if experiment is None:
            return self._client.create_experiment(
                _EXPERIMENT, tags={EXPERIMENT_KIND_TAG: MODEL_DEVELOPMENT}
            )
        if experiment.tags.get(EXPERIMENT_KIND_TAG) != MODEL_DEVELOPMENT:
            # An experiment made before MinT set its kind (MLflow would open it as GenAI).
            self._client.set_experiment_tag(
                experiment.experiment_id, EXPERIMENT_KIND_TAG, MODEL_DEVELOPMENT
            )
        return experiment.experiment_id

    def start_training_run(
        self, adapter: str, params: Mapping[str, str], dataset: DatasetLog
    ) -> str:
        """An MLflow run for training a revision of `adapter`: its hyperparameters as params,
        its dataset as the run's input (with the file as an artifact when it is local). The
        loss curve follows (`log_losses`), then `finish_training_run`."""
        try:
            run_id = self._client.create_run(
                self._experiment_id(),
                run_name=f"{adapter}-train",
                tags={TAG_PREFIX + "adapter": adapter},
            ).info.run_id
            self._client.log_batch(
                run_id, params=[Param(name, value) for name, value in sorted(params.items())]
            )
            self._client.log_inputs(run_id, [dataset.input()])
            if dataset.local_path is not None:
                self._client.log_artifact(run_id, str(dataset.local_path), "dataset")
        except MlflowException as e:
            raise RegistryError(f"MLflow refused a training run for {adapter!r}: {e}") from e
        return run_id

    def log_params(self, run_id: str, params: Mapping[str, str]) -> None:
        """Every param in `params`, in one request (a param, once logged, never changes)."""
        self._client.log_batch(
            run_id, params=[Param(name, value) for name, value in sorted(params.items())]
        )

    def log_losses(self, run_id: str, name: str, losses: Sequence[tuple[int, float]]) -> None:
        """Metric `name` at each (step, value), in one request."""
        now = int(datetime.now(UTC).timestamp() * 1000)
        metrics = [Metric(name, value, now, step) for step, value in losses]
        self._client.log_batch(run_id, metrics=metrics)

    def log_metrics(self, run_id: str, step: int, metrics: Mapping[str, float]) -> None:
        """Every metric in `metrics` at `step`, in one request."""
        now = int(datetime.now(UTC).timestamp() * 1000)
        batch = [Metric(name, value, now, step) for name, value in sorted(metrics.items())]
        self._client.log_batch(run_id, metrics=batch)

    def finish_training_run(
        self, run_id: str, metrics: Mapping[str, float], step: int, failed: bool = False
    ) -> None:
        """Record the evaluation metrics and end the run (FAILED when training failed)."""
        for name, value in metrics.items():
            self._client.log_metric(run_id, name, value, step=step)
        self._client.set_terminated(run_id, "FAILED" if failed else "FINISHED")

    def _log_release_run(self, policy: PolicyRecord, run_id: str | None) -> str:
        """The policy record as a JSON artifact of the training run, or of a new run (an
        imported adapter, which has no training run)."""
        if run_id is None:
            run_id = self._client.create_run(
                self._experiment_id(),
                run_name=f"{policy.adapter}-{policy.content_digest[7:19]}",
                tags={TAG_PREFIX + "adapter": policy.adapter},
            ).info.run_id
            for name, value in policy.eval_metrics.items():
                self._client.log_metric(run_id, name, value, step=policy.training_steps)
            self._client.set_terminated(run_id)
        self._client.log_text(run_id, policy.to_json(), POLICY_FILE)
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
        self._client.set_model_version_tag(
            revision.adapter, str(revision.number), STAGE_TAG, stage.value
        )
        self._append_stage_history(registered, stage, actor, reason)

    def note_stage(self, revision: RevisionId, actor: str, reason: str, approver: str = "") -> None:
        """Add a note to a revision's stage history, its stage staying as it is (from = to):
        what happened to it, such as a repair, that moved no stage. `approver`: the note is
        that person's approval of its roll-out."""
        registered = self.get(revision)
        self._append_stage_history(registered, registered.stage, actor, reason, approver)

    def _append_stage_history(
        self,
        registered: RegisteredRevision,
        stage: Stage,
        actor: str,
        reason: str,
        approver: str = "",
    ) -> None:
        history = json.loads(registered.tags.get(STAGE_HISTORY_TAG, "[]"))
        history.append(
            {"at": _now(), "from": registered.stage.value, "to": stage.value, "actor": actor,
             "reason": reason[:_REASON_CHARS]} | ({"approver": approver} if approver else {})
        )  # fmt: skip
        value = json.dumps(history)
        self._client.set_model_version_tag(
            registered.id.adapter, str(registered.id.number), STAGE_HISTORY_TAG, value
        )
        self._describe_version(
            replace(registered, tags={**registered.tags, STAGE_HISTORY_TAG: value})
        )

    def _describe_version(self, registered: RegisteredRevision) -> None:
        """Write the version's history table (`mint_core.history`) from its tags: its stage
        history and the alias moves recorded on it. Called wherever those tags are written."""
        moves = sorted(
            (
                record.move
                for key, value in registered.tags.items()
                if key.startswith(ALIAS_MOVE_TAG) and (record := _MoveRecord.from_tag(value)).done
            ),
            key=lambda move: move.number,
        )
        history = json.loads(registered.tags.get(STAGE_HISTORY_TAG, "[]"))
        self._client.update_model_version(
            registered.id.adapter,
            str(registered.id.number),
            description=version_description(registered.description, history, moves),
        )

    def set_revision_tag(self, revision: RevisionId, key: str, value: str) -> None:
        with self._failing(f"tag {revision} with {key}"):
            self._client.set_model_version_tag(revision.adapter, str(revision.number), key, value)

    def stage_history(self, revision: RevisionId) -> list[dict[str, str]]:
        return json.loads(self.get(revision).tags.get(STAGE_HISTORY_TAG, "[]"))

    def reject(self, revision: RevisionId, actor: str, reason: str) -> None:
        """Record that a gate (evaluation, approval, canary) stopped `revision` before
        activation, and why; it stops being the adapter's `candidate`, so workers stop keeping
        it for a roll-out that will not come."""
        self.set_stage(revision, Stage.REJECTED, actor, reason)
        if CANDIDATE in self.get(revision).aliases:
            self.drop_alias(revision.adapter, CANDIDATE)

    def mark_failed(self, revision: RevisionId, reason: str, actor: str = "mint") -> None:
        """Record that a pipeline step failed for `revision`, and why."""
        self.set_stage(revision, Stage.FAILED, actor, reason[:4000])
        self._client.set_model_version_tag(
            revision.adapter, str(revision.number), FAILURE_TAG, reason[:4000]
        )

    def move_alias(
        self,
        revision: RevisionId,
        alias: str,
        actor: str = "mint",
        reason: str = "",
        approver: str = "",
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
        seen elsewhere (`_moves_made`); killed after the alias moved, readers count the intent,
        since the alias was next seen at its target. Moves of one adapter are serialized by its
        roll-out lock, which keeps their numbers unique."""
        model = self._registered_model(revision.adapter)
        if model is None:
            raise NotFoundError(f"adapter {revision.adapter!r} is not registered")
        before = (model.aliases or {}).get(alias)
        records = self._move_records(revision.adapter)
        number = max((r.move.number for r in records), default=0)
        move = AliasMove(
            number + 1,
            _now(),
            alias,
            int(before) if before is not None else None,
            revision.number,
            actor,
            reason[:_REASON_CHARS],
            approver,
        )
        adapter, version = revision.adapter, str(revision.number)
        with self._failing(f"move {adapter}@{alias} to {revision}"):
            record = _MoveRecord(move, done=False)
            self._client.set_model_version_tag(adapter, version, move.tag, record.to_tag())
            intent = AliasIntent(revision.number, move.from_revision, actor, move.at, done=False)
            self._intend(adapter, alias, intent)
            self._client.set_registered_model_alias(adapter, alias, version)
            self._intend(adapter, alias, replace(intent, done=True))
            aliases = {a: int(v) for a, v in (model.aliases or {}).items()}
            aliases[alias] = move.to_revision  # the move has happened: the table shows it
            self._touch(adapter, model, _moves_made([*records, record], aliases))
            if alias != CANARY:  # a canary's moves (its start, its end) activate nothing
                self._client.set_model_version_tag(adapter, version, ACTIVATED_AT_TAG, move.at)
            done = _MoveRecord(move, done=True)
            self._client.set_model_version_tag(adapter, version, move.tag, done.to_tag())
            self._describe_version(self.get(revision))
        return move.from_revision

    @contextmanager
    def _failing(self, action: str) -> Iterator[None]:
        """MLflow's refusals inside the block as RegistryError naming `action` (a server that
        does not answer raises RegistryError already)."""
        try:
            yield
        except MlflowException as e:
            raise RegistryError(f"MLflow failed to {action}: {e}") from e

    def point_alias(self, revision: RevisionId, alias: str, actor: str = "mint") -> None:
        """Set `adapter@alias` to `revision` with no history: for working aliases such as
        `candidate`. Workers see the change at their next sync."""
        adapter = revision.adapter
        intent = self._intent_from(adapter, alias, revision.number, actor)
        with self._failing(f"point {adapter}@{alias} at {revision}"):
            self._intend(adapter, alias, intent)
            self._client.set_registered_model_alias(adapter, alias, str(revision.number))
            self._intend(adapter, alias, replace(intent, done=True))
        self._touch(adapter)

    def drop_alias(self, adapter: str, alias: str, actor: str = "mint") -> None:
        """Remove `adapter@alias` (nothing happens if it does not exist)."""
        if self._registered_model(adapter) is None:
            return
        intent = self._intent_from(adapter, alias, None, actor)
        with self._failing(f"remove {adapter}@{alias}"):
            self._intend(adapter, alias, intent)
        try:
            self._client.delete_registered_model_alias(adapter, alias)
        except MlflowException as e:
            if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise RegistryError(f"MLflow failed to remove {adapter}@{alias}: {e}") from e
        with self._failing(f"remove {adapter}@{alias}"):
            self._intend(adapter, alias, replace(intent, done=True))
        self._touch(adapter)

    def _intent_from(
        self, adapter: str, alias: str, revision: int | None, actor: str
    ) -> AliasIntent:
        """The intent of moving `adapter@alias` from where it is now to `revision`."""
        model = self._registered_model(adapter)
        before = (model.aliases or {}).get(alias) if model else None
        previous = int(before) if before is not None else None
        return AliasIntent(revision, previous, actor, _now(), done=False)

    def _intend(self, adapter: str, alias: str, intent: AliasIntent) -> None:
        """Record the pipeline's move of `adapter@alias` (see `mint_core.alias_intents`):
        workers follow an alias only where an intent accounts for it."""
        self._client.set_registered_model_tag(adapter, INTENT_TAG + alias, intent.to_tag())

    def start_canary(
        self, revision: RevisionId, percent: float, actor: str = "mint", reason: str = ""
    ) -> int | None:
        """Send `percent` of `adapter@production`'s requests to `revision` on every worker that
        has it ready: `adapter@canary` moves to it (recorded in the alias history) and the share
        is set beside it. The revision `canary` named before, if any. Workers follow at their
        next sync; a worker that does not have `revision` ready keeps serving production."""
        check_canary_percent(percent)
        if self._registered_model(revision.adapter) is None:
            raise NotFoundError(f"adapter {revision.adapter!r} is not registered")
        with self._failing(f"set the canary share of {revision.adapter!r}"):
            # The share first: a worker that syncs in between sees it with the old canary, or
            # with none (no canary traffic), never a new canary at a stale share.
            self._client.set_registered_model_tag(
                revision.adapter, CANARY_PERCENT_TAG, str(float(percent))
            )
        return self.move_alias(revision, CANARY, actor, reason)

    def end_canary(self, adapter: str, actor: str = "mint", reason: str = "") -> RevisionId | None:
        """Stop sending `adapter@production`'s requests to a canary: the share is removed, the
        end is recorded in the alias history as a move of `canary` to the `production` revision
        with `reason` (the decision and its figures), and the alias is dropped. The revision the
        canary named; None, and nothing recorded, if there was no canary. Idempotent."""
        model = self._registered_model(adapter)
        if model is None:
            raise NotFoundError(f"adapter {adapter!r} is not registered")
        aliases = model.aliases or {}
        canary = aliases.get(CANARY)
        if CANARY_PERCENT_TAG in (model.tags or {}):
            with self._failing(f"remove the canary share of {adapter!r}"):
                self._client.delete_registered_model_tag(adapter, CANARY_PERCENT_TAG)
            if canary is None:
                self._touch(adapter, model)  # the moves below touch it otherwise
        if canary is None:
            return None
        # Without `production` the end is recorded on the canary revision itself.
        landing = int(aliases.get(PRODUCTION, canary))
        self.move_alias(RevisionId(adapter, landing), CANARY, actor, reason)
        self.drop_alias(adapter, CANARY)
        return RevisionId(adapter, int(canary))

    def canary(self, adapter: str) -> tuple[RevisionId, float] | None:
        """The canary revision of `adapter` and its share in percent, as the registry has them
        now; None when there is no canary."""
        model = self._registered_model(adapter)
        if model is None:
            raise NotFoundError(f"adapter {adapter!r} is not registered")
        canary = (model.aliases or {}).get(CANARY)
        percent = _canary_percent(model)
        if canary is None or percent is None:
            return None
        return RevisionId(adapter, int(canary)), percent

    def _touch(
        self,
        adapter: str,
        model: RegisteredModel | None = None,
        moves: Sequence[AliasMove] | None = None,
    ) -> None:
        # MLflow does not count an alias or tag change as an update of the registered model;
        # re-setting its description does, and workers find changes by that time.
        model = model or self._registered_model(adapter)
        description = (model.description or "") if model else ""
        if moves is not None:  # the alias history table, rewritten with the moves made
            description = adapter_description(description, moves)
        self._client.update_registered_model(adapter, description=description)

    def adapters_changed_since(self, since_ms: int, page_size: int = 20) -> list[AdapterAliases]:
        """Every adapter updated (new revision, alias moved) at or after `since_ms` on the
        registry's clock, newest first: what a worker needs to catch up. The first page is
        small, as a sync usually finds a few changes at most; each next one is larger, up to
        MLflow's largest, so reading every adapter takes few requests. RegistryError if MLflow
        cannot answer."""
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
                        base = model.tags.get(TAG_PREFIX + "base_digest", "")
                        changed.append(
                            AdapterAliases(
                                model.name,
                                aliases,
                                model.last_updated_timestamp,
                                base,
                                _canary_percent(model),
                                intents_of(model.tags),
                            )
                        )
                page_token = page.token
                if not page_token:
                    return changed
                # Page tokens are offsets, so the size may change from page to page.
                page_size = min(page_size * 10, MODELS_PAGE_MAX)
        except (MlflowException, OSError) as e:  # OSError: the server does not answer
            raise RegistryError(f"MLflow at {self.tracking_uri} cannot list adapters: {e}") from e

    def all_revisions(self, page_size: int = VERSIONS_PAGE) -> Iterator[list[RegisteredRevision]]:
        """Every revision of every adapter, a page at a time, in name and number order: what a
        catalog is built from. Versions that carry no policy record (models that are not MinT
        adapters) are left out. A revision registered while this runs may be missed: a catalog
        asks for one it lacks when it is named. RegistryError if MLflow cannot answer."""
        page_token = None
        while True:
            with self._failing("list every revision"):
                page = self._client.search_model_versions(
                    max_results=page_size,
                    order_by=["name ASC", "version_number ASC"],
                    page_token=page_token,
                )
            revisions = []
            for version in page:
                if (version.tags or {}).get(TAG_PREFIX + "content_digest") is None:
                    continue
                try:
                    revisions.append(self._revision(version, tuple(sorted(version.aliases or ()))))
                except ConfigurationError as e:  # asked for by name, it fails there, as today
                    log.warning(
                        "left %s:r%s out of the catalog: %s", version.name, version.version, e
                    )
            yield revisions
            page_token = page.token
            if not page_token:
                return

    def alias_history(self, adapter: str) -> list[AliasMove]:
        """Every alias move of `adapter` that happened, oldest first (see `move_alias`)."""
        return self._history(adapter)[1]

    def previous(self, adapter: str, alias: str = PRODUCTION) -> RevisionId:
        """The revision `alias` pointed at before its current one: what a rollback returns to."""
        aliases, history = self._history(adapter)
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

    def _history(self, adapter: str) -> tuple[dict[str, int], list[AliasMove]]:
        """Where `adapter`'s aliases point now, and the moves that took them there."""
        model = self._registered_model(adapter)
        if model is None:
            raise NotFoundError(f"adapter {adapter!r} is not registered")
        aliases = {alias: int(version) for alias, version in (model.aliases or {}).items()}
        return aliases, _moves_made(self._move_records(adapter), aliases)

    def _move_records(self, adapter: str) -> list[_MoveRecord]:
        """Every alias-move record of `adapter`, in order: one search, paged."""
        records = []
        page_token = None
        with self._failing(f"read the alias history of {adapter!r}"):
            while True:
                page = self._client.search_model_versions(
                    f"name = '{adapter}'", page_token=page_token
                )
                for version in page:
                    records += [
                        _MoveRecord.from_tag(value)
                        for key, value in (version.tags or {}).items()
                        if key.startswith(ALIAS_MOVE_TAG)
                    ]
                page_token = page.token
                if not page_token:
                    break
        return sorted(records, key=lambda record: record.move.number)

    def gates(self, adapter: str) -> Gates:
        """What `adapter`'s roll-outs must pass (defaults if none were set: no approval)."""
        model = self._registered_model(adapter)
        if model is None:
            raise NotFoundError(f"adapter {adapter!r} is not registered")
        raw = (model.tags or {}).get(GATES_TAG)
        return Gates.from_json(raw) if raw else Gates()

    def set_gates(self, adapter: str, gates: Gates) -> None:
        if self._registered_model(adapter) is None:
            raise NotFoundError(
                f"adapter {adapter!r} is not registered; release its first revision, then set "
                "its gates"
            )
        with self._failing(f"set the gates of {adapter!r}"):
            self._client.set_registered_model_tag(adapter, GATES_TAG, gates.to_json())

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
            description=version.description or "",
        )


def check_canary_percent(percent: float) -> float:
    """`percent` if it is a share a canary can have: more than 0, at most 100."""
    if not 0 < percent <= 100:  # NaN fails too
        raise ConfigurationError(
            f"canary share {percent}% is not valid; give a percentage of production's "
            "requests above 0 and at most 100 (e.g. 10)"
        )
    return percent


def _canary_percent(model: RegisteredModel) -> float | None:
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


def _now() -> str:
    return datetime.now(UTC).isoformat()
