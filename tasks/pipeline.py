"""The release pipeline's steps as Prefect tasks: each a thin call into mint_core (or, for
the fleet steps, into the workers' HTTP API).

Prefect's own mechanisms do the operational work: retries on the steps that cross the network,
persisted results keyed by flow run for the expensive steps (a rerun of a failed run, such as
"Retry" in the Prefect UI, skips training and reuses the revision it already registered), and
a strict global concurrency limit per adapter around rolling a revision out.
"""

import logging
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

from prefect import get_client, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import INPUTS, NO_CACHE, RUN_ID, TASK_SOURCE
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.client.schemas.objects import State
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
from tqdm.auto import tqdm

from mint_core.access import EVERYONE
from mint_core.artifact_store import open_store, read_data
from mint_core.catalog import build_snapshot
from mint_core.catalog_snapshot import Snapshot
from mint_core.config import MintConfig
from mint_core.errors import (
    IntegrityError,
    MintError,
    NotFoundError,
    NotReadyError,
    RegistryError,
    RejectedError,
    RolloutBusyError,
    ServiceError,
)
from mint_core.evaluation import (
    EVAL_ROWS_TAG,
    EvalSet,
    Evaluation,
    Generate,
    SetScore,
    exact_match,
    rows_name,
    to_jsonl,
)
from mint_core.freezing import FrozenAdapter, freeze, open_frozen
from mint_core.gates import Gates
from mint_core.model.base import identity, load_base
from mint_core.model.datasets import Dataset, Row, load_datasets, located, parse_jsonl
from mint_core.model.imports import ImportedAdapter, inspect_import
from mint_core.model.training import (
    EVAL_GENERATION_ROWS,
    TrainedAdapter,
    TrainingConfig,
    train_lora,
)
from mint_core.packing import DEFAULT_SHARD_BYTES, PackedIndex, pack
from mint_core.registry import DatasetLog, Registry, check_activatable
from mint_core.revisions import CANDIDATE, PRODUCTION, PolicyRecord, RevisionId, RevisionRef
from mint_core.states import Stage
from serving.client import WorkerClient
from tasks.runs import run_log

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Exported:
    uri: str
    content_digest: str


# Within one flow run (first attempt or a rerun of it), same step + same inputs = same result.
_ONCE_PER_RUN = TASK_SOURCE + INPUTS + RUN_ID


def transient(task: object, task_run: object, state: State) -> bool:
    """Whether a failed step may go otherwise if tried again: a service that did not answer
    (or an error MinT did not foresee), not a refusal that would be the same every time (a
    bad data file, a missing revision, a digest mismatch)."""
    error = state.result(raise_on_failure=False)
    return not isinstance(error, MintError) or isinstance(
        error, ServiceError | RegistryError | NotReadyError
    )


@task(
    name="load-data",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=1,
    retry_condition_fn=transient,
)
def load_data(
    config: MintConfig, data: str, eval_data: str | None, eval_fraction: float, seed: int
) -> tuple[Dataset, Dataset]:
    """(training rows, held-out rows), each file read and checked whole: `eval_data` when
    given, else a seeded `eval_fraction` of `data`'s rows."""
    return load_datasets(partial(read_data, config), data, eval_data, eval_fraction, seed)


@task(name="train", cache_policy=_ONCE_PER_RUN, persist_result=True)
def train_adapter(
    config: MintConfig,
    adapter: str,
    data: Dataset,
    held_out: Dataset,
    training: TrainingConfig,
) -> TrainedAdapter:
    """Train in this process, inside an MLflow run that records the hyperparameters, the
    dataset, the loss of every step and the evaluation metrics."""
    registry = Registry(config.tracking_uri)
    local = None if data.source.startswith("s3://") else Path(data.source)
    run_facts = {
        "base_model": config.base.name or "(embedded default)",
        "train_rows": str(len(data.rows)),
        "eval_rows": str(len(held_out.rows)),
        "eval_data": held_out.describe(path=True) if held_out.held_out else held_out.source,
    }
    run_id = registry.start_training_run(
        adapter, run_facts, DatasetLog(data.source, data.digest, len(data.rows), local)
    )
    # The hyperparameters are logged once the base is loaded, with the targets as trained (its
    # family's default resolved); as asked, if training fails before.
    logged: list[TrainingConfig] = []

    def started(resolved: TrainingConfig) -> None:
        registry.log_params(run_id, resolved.params())
        logged.append(resolved)

    out_dir = config.work_root / "train" / f"{adapter}-{uuid.uuid4().hex[:12]}"
    with _TrainingProgress(registry, run_id, run_log()) as progress:
        try:
            trained = train_lora(
                config.base, config.home, data, held_out, out_dir, training, progress.step, started
            )
        except BaseException:
            progress.flush()
            if not logged:
                registry.log_params(run_id, training.params())
            registry.finish_training_run(run_id, {}, 0, failed=True)
            raise
    registry.finish_training_run(run_id, trained.eval_metrics, trained.steps)
    return replace(trained, run_id=run_id)


class _TrainingProgress:
    """Each step's loss to the MLflow run (a few steps per request), to a progress bar on a
    terminal, and (step, loss, ETA) to the run's log about ten times per training."""

    LOG_EVERY = 20
    LOG_LINES = 10

    def __init__(
        self,
        registry: Registry,
        run_id: str,
        log: logging.Logger | logging.LoggerAdapter[logging.Logger],
    ) -> None:
        self._registry = registry
        self._run_id = run_id
        self._log = log
        self._pending: list[tuple[int, float]] = []
        self._bar: tqdm | None = None
        self._started = time.monotonic()

    def __enter__(self) -> "_TrainingProgress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.flush()
        if self._bar is not None:
            self._bar.close()

    def step(self, step: int, total: int, loss: float) -> None:
        if self._bar is None:
            # disable=None: a bar on a terminal, nothing in logs.
            self._bar = tqdm(total=total, desc="train", unit="step", disable=None)
        self._bar.update(1)
        self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        self._pending.append((step, loss))
        if len(self._pending) >= self.LOG_EVERY or step == total:
            self.flush()
        if step % max(1, total // self.LOG_LINES) == 0 or step == total:
            elapsed = time.monotonic() - self._started
            eta = elapsed / step * (total - step)
            self._log.info(
                "training step %d/%d: loss %.4f, %.0f s elapsed, ETA %.0f s",
                step,
                total,
                loss,
                elapsed,
                eta,
            )

    def flush(self) -> None:
        if self._pending:
            self._registry.log_losses(self._run_id, "train_loss", self._pending)
            self._pending = []


@task(name="check-import", cache_policy=NO_CACHE)
def check_import(config: MintConfig, adapter_dir: Path, same_base_as: str = "") -> ImportedAdapter:
    return inspect_import(adapter_dir, load_base(config.base, config.home), same_base_as)


@task(name="freeze", cache_policy=NO_CACHE)
def freeze_adapter(config: MintConfig, adapter_dir: Path) -> FrozenAdapter:
    return freeze(adapter_dir, config.frozen_root)


@task(name="pack", cache_policy=NO_CACHE)
def pack_adapter(
    config: MintConfig, frozen: FrozenAdapter, shard_bytes: int = DEFAULT_SHARD_BYTES
) -> tuple[Path, PackedIndex]:
    out_dir = config.work_root / "packed" / frozen.digest.removeprefix("sha256:")
    return out_dir, pack(frozen, out_dir, shard_bytes)


@task(
    name="export",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=1,
    retry_condition_fn=transient,
)
def export_adapter(config: MintConfig, packed_dir: Path, index: PackedIndex) -> Exported:
    store = open_store(config)
    return Exported(store.put(packed_dir, index.content_digest), index.content_digest)


# No task retries: MLflow's client already retries its requests, and a retry after a lost reply
# to create_model_version would register a second revision.
@task(name="register", cache_policy=_ONCE_PER_RUN, persist_result=True)
def register_revision(
    config: MintConfig,
    adapter: str,
    source: TrainedAdapter | ImportedAdapter,
    frozen: FrozenAdapter,
    exported: Exported,
    actor: str,
    principals: tuple[str, ...] = (EVERYONE,),
    held_out: Dataset | None = None,
    parent: RevisionRef | None = None,
) -> RevisionId:
    """Register the next revision of `adapter`, with the `held_out` rows a trained one was
    evaluated on kept in the artifact store: its evaluation gate, and later candidates', score
    on them. Its parent is the revision `parent` names (a release's is `adapter@production`,
    an RL sync's the revision it trained from), if that resolves to one."""
    registry = Registry(config.tracking_uri)
    try:
        parent_number = registry.resolve(parent).id.number if parent else None
    except NotFoundError:
        parent_number = None
    policy = PolicyRecord(
        adapter=adapter,
        content_digest=exported.content_digest,
        created_by=actor,
        created_at=datetime.now(UTC).isoformat(),
        parent_revision=parent_number,
        frozen_digest=frozen.digest,
        principals=principals,
        **source.policy_fields(),  # type: ignore[arg-type]
    )
    serving_base = identity(config.base, config.home).digest
    run_id = source.run_id if isinstance(source, TrainedAdapter) else None
    revision = registry.register(policy, exported.uri, serving_base, run_id).id
    if held_out is not None:
        registry.set_revision_tag(revision, EVAL_ROWS_TAG, _store_rows(config, held_out))
    run_log().info("registered %s (%s)", revision, exported.content_digest)
    return revision


def _store_rows(config: MintConfig, rows: Dataset) -> str:
    """Keep `rows` in the artifact store, named by their content; the name."""
    jsonl = to_jsonl(rows.rows)
    name = rows_name(jsonl)
    staging = config.work_root / "eval-rows" / f".{uuid.uuid4().hex}.jsonl"
    staging.parent.mkdir(parents=True, exist_ok=True)
    try:
        staging.write_bytes(jsonl)
        open_store(config).put_file(name, staging)
    finally:
        staging.unlink(missing_ok=True)
    return name


ROLLOUT_TIMEOUT_S = 900.0
"""How long a roll-out waits for another roll-out of the same adapter to finish."""


@contextmanager
def rollout_lock(adapter: str, timeout_s: float | None = None) -> Iterator[None]:
    """Hold `adapter`'s roll-out slot: a strict Prefect global concurrency limit of 1, so no
    two releases, promotions, rollbacks or repairs of one adapter admit and move its alias at
    once, in any process. The limit is created on first use. A holder that dies frees the slot
    when its lease (60 s, renewed while it lives) runs out. RolloutBusyError if the slot stays
    taken for `timeout_s` (default `ROLLOUT_TIMEOUT_S`): the caller has changed nothing yet."""
    timeout_s = ROLLOUT_TIMEOUT_S if timeout_s is None else timeout_s
    name = f"mint-rollout-{adapter}"
    with get_client(sync_client=True) as client:
        # Look before creating: a create of an existing name fails inside the Prefect server,
        # which logs a traceback for it (every roll-out takes its slot twice). Only two
        # processes creating the same new limit at once still meet that, harmlessly.
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            with suppress(ObjectAlreadyExists):
                client.create_global_concurrency_limit(
                    GlobalConcurrencyLimitCreate(name=name, limit=1)
                )
    with ExitStack() as held:
        try:
            held.enter_context(
                concurrency(name, strict=True, timeout_seconds=timeout_s, lease_duration=60)
            )
        except TimeoutError as e:
            raise RolloutBusyError(
                f"the roll-out slot of {adapter!r} ({name}) was busy for {timeout_s:.0f} s: "
                "another release, promote, rollback or repair of it is running. Nothing was "
                "changed; run this again once that one has finished"
            ) from e
        yield


def base_fleet(config: MintConfig, revision: RevisionId) -> list[WorkerClient]:
    """The workers that serve `revision`'s base: only they admit, prewarm and activate it, and
    only they are waited for. A worker names its base in `/health`. ServiceError if one does
    not answer (it might serve that base: nothing is guessed), NotReadyError if none serves
    the base."""
    policy = Registry(config.tracking_uri).get(revision).policy
    workers = [WorkerClient(url, config.worker_api_key) for url in config.worker_urls]
    serving = [w for w in workers if w.health()["base_digest"] == policy.base_digest]
    if not serving:
        raise NotReadyError(
            f"no worker in MINT_WORKER_URLS ({', '.join(config.worker_urls)}) serves the base of "
            f"{revision}, {policy.base_model_id} ({policy.base_digest}): start one with "
            "MINT_BASE_MODEL set to that base and add its URL"
        )
    return serving


@task(
    name="admit",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=1,
    retry_condition_fn=transient,
)
def admit_revision(config: MintConfig, revision: RevisionId, rollback: bool = False) -> None:
    """Make `revision` the adapter's `candidate` (workers that restart take it in again) and
    queue it on every worker of its base; a rollback goes to the front of their queues."""
    workers = base_fleet(config, revision)
    registry = Registry(config.tracking_uri)
    registry.point_alias(revision, CANDIDATE)
    for worker in workers:
        worker.admit(revision, "rollback" if rollback else "normal")
    registry.set_stage(revision, Stage.ADMITTED)


@task(
    name="readmit",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=1,
    retry_condition_fn=transient,
)
def readmit_revision(config: MintConfig, revision: RevisionId) -> None:
    """Queue `revision` again on every worker of its base, ahead of anything else: one that
    failed it takes it again, one that has it ready keeps it. Its stage and aliases stay as
    they are."""
    for worker in base_fleet(config, revision):
        worker.admit(revision, "rollback")


@task(name="prewarm", cache_policy=NO_CACHE)
def prewarm_revision(config: MintConfig, revision: RevisionId, timeout_s: float = 300.0) -> None:
    registry = Registry(config.tracking_uri)
    registry.set_stage(revision, Stage.PREWARMING)
    wait_fleet_ready(config, revision, timeout_s)
    registry.set_stage(revision, Stage.READY)


def wait_fleet_ready(config: MintConfig, revision: RevisionId, timeout_s: float) -> None:
    """Return once every worker of `revision`'s base reports it ready; NotReadyError naming
    each worker that failed it, never admitted it, or ran out of time."""
    problems = []
    for worker in base_fleet(config, revision):
        try:
            worker.wait_ready(revision, timeout_s)
        except NotReadyError as e:
            problems.append(str(e))
    if problems:
        raise NotReadyError(f"{revision} is not ready on the fleet: {'; '.join(problems)}")


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate_revision(
    config: MintConfig, revision: RevisionId, gates: Gates, actor: str = "mint"
) -> Evaluation | None:
    """Score `revision` and the revision serving `production` on the same rows, through one
    worker of their base: the eval set (the gates' `eval_data`, else production's held-out
    rows, else the candidate's own) and the gates' `regression_data`. Both scores go on the
    candidate's model version and into a Prefect table artifact `eval-<adapter>`. RejectedError
    (stage `rejected`) when the candidate falls behind by more than `gates.max_regression` on
    any set. None, noted in the stage history, when there is nothing to compare: no
    production revision (training already scored a first revision on its held-out rows) or
    no rows."""
    registry = Registry(config.tracking_uri)
    try:
        production = registry.resolve(RevisionRef(revision.adapter)).id
    except NotFoundError:
        production = None
    if production in (None, revision):
        registry.note_stage(revision, actor, "evaluation passed: no other revision in production")
        run_log().info("%s evaluation passed: no other revision in production", revision)
        return None
    sets = _eval_sets(config, registry, revision, production, gates)
    if not sets:
        registry.note_stage(
            revision,
            actor,
            f"evaluation passed: no rows to score {revision} and {production} on (neither has "
            "held-out rows, and the adapter's gates name no eval_data)",
        )
        run_log().info("%s evaluation passed: no rows to score it and %s on", revision, production)
        return None
    worker = base_fleet(config, revision)[0]

    def served(which: RevisionId) -> Generate:
        return lambda prompts, budget: worker.answers(str(which), prompts, budget)

    scores = tuple(
        SetScore(
            name,
            len(rows),
            exact_match(rows, served(revision)),
            exact_match(rows, served(production)),
            source,
        )
        for name, (rows, source) in sets.items()
    )
    evaluation = Evaluation(revision, production, scores, gates.max_regression)
    for key, value in evaluation.tags().items():
        registry.set_revision_tag(revision, key, value)
    create_table_artifact(
        evaluation.table(), key=f"eval-{revision.adapter}", description=evaluation.reason()
    )
    if not evaluation.passed:
        registry.reject(revision, actor, evaluation.reason())
        run_log().warning("%s %s", revision, evaluation.reason())
        raise RejectedError(f"{evaluation.reason()}; production did not move")
    registry.note_stage(revision, actor, evaluation.reason())
    run_log().info("%s %s", revision, evaluation.reason())
    return evaluation


def _eval_sets(
    config: MintConfig,
    registry: Registry,
    revision: RevisionId,
    production: RevisionId,
    gates: Gates,
) -> dict[EvalSet, tuple[tuple[Row, ...], str]]:
    """Each set's rows, at most EVAL_GENERATION_ROWS (each is a generation per revision), and
    where they come from ("of eval.jsonl")."""
    files = {EvalSet.EVAL: gates.eval_data, EvalSet.REGRESSION: gates.regression_data}
    sets = {
        name: (
            parse_jsonl(read_data(config, where), located(where)).rows,
            f"of {where.rstrip('/').rsplit('/', 1)[-1]}",
        )
        for name, where in files.items()
        if where
    }
    if EvalSet.EVAL not in sets:
        # Production's rows first: a candidate trained on another task would pass on its own.
        for holder in (production, revision):
            stored = _stored_rows(config, registry, holder)
            if stored is not None:
                sets[EvalSet.EVAL] = (stored, f"{holder} was evaluated on in training")
                break
    return {
        name: (sets[name][0][:EVAL_GENERATION_ROWS], sets[name][1])
        for name in EvalSet
        if name in sets
    }


def _stored_rows(
    config: MintConfig, registry: Registry, revision: RevisionId
) -> tuple[Row, ...] | None:
    """The held-out rows `revision` was trained with, from the artifact store; None if it has
    none (an imported adapter)."""
    name = registry.get(revision).tags.get(EVAL_ROWS_TAG)
    if name is None:
        return None
    staging = config.work_root / "eval-rows" / f".{uuid.uuid4().hex}.jsonl"
    staging.parent.mkdir(parents=True, exist_ok=True)
    try:
        if not open_store(config).get_file(name, staging):
            raise NotFoundError(
                f"the eval rows of {revision} ({name}) are gone from the artifact store; name "
                f"the eval rows of {revision.adapter!r} in its gates (eval_data)"
            )
        return parse_jsonl(staging.read_bytes(), f"{revision}'s eval rows ({name})").rows
    finally:
        staging.unlink(missing_ok=True)


@task(name="activate", cache_policy=NO_CACHE)
def activate_revision(
    config: MintConfig,
    revision: RevisionId,
    alias: str = PRODUCTION,
    actor: str = "mint",
    reason: str = "release",
    timeout_s: float = 300.0,
    approver: str = "",
) -> None:
    """Move `alias` to `revision` once every worker of its base reports it ready (waiting up to
    `timeout_s`); if one fails it or time runs out, the alias stays where it was. Then nudge
    the workers, so they switch new requests at once instead of at their next sync. `approver`
    (who approved this roll-out, if its gates asked) is recorded on the move."""
    registry = Registry(config.tracking_uri)
    check_activatable(registry.get(revision))
    try:
        wait_fleet_ready(config, revision, timeout_s)
    except NotReadyError as e:
        raise NotReadyError(f"not moving {revision.adapter}@{alias} to {revision}: {e}") from e
    # Read again after the wait (minutes, perhaps): the activation writes on from this record.
    registered = registry.get(revision)
    check_activatable(registered)
    previous = registry.activate(registered, alias, actor, reason, approver)
    before = "none" if previous is None else f"r{previous}"
    run_log().info("%s@%s %s → r%d (%s)", revision.adapter, alias, before, revision.number, reason)
    for url in config.worker_urls:  # every base's: a worker that does not serve it syncs fast
        try:
            WorkerClient(url, config.worker_api_key).sync()
        except ServiceError as e:  # it catches up at its next sync all the same
            log.warning("could not nudge worker %s to sync: %s", url, e)


@task(
    name="ensure-exported",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=1,
    retry_condition_fn=transient,
)
def ensure_exported(
    config: MintConfig, revision: RevisionId, shard_bytes: int = DEFAULT_SHARD_BYTES
) -> bool:
    """Make sure the revision's artifact is intact in the store, exporting it again from its
    frozen files if it is missing or damaged there; whether it had to. Packing may differ from
    the first export (shard size, a newer packer): the content digest names the tensors, not
    their packing. Never retrains: with the frozen files gone it fails clearly."""
    registered = Registry(config.tracking_uri).get(revision)
    store = open_store(config)
    if store.holds(registered.artifact_uri):
        return False
    frozen_digest = registered.policy.frozen_digest
    frozen_path = config.frozen_root / (frozen_digest or "").removeprefix("sha256:")
    if not frozen_digest or not frozen_path.is_dir():
        raise NotFoundError(
            f"{revision} cannot be served again: its artifact is missing or damaged in the "
            f"store ({registered.artifact_uri}) and its "
            f"frozen files ({frozen_digest}) are gone from {config.frozen_root}; release a new "
            "revision instead"
        )
    frozen = open_frozen(frozen_path)
    packed_dir, index = pack_adapter.fn(config, frozen, shard_bytes)
    if index.content_digest != registered.policy.content_digest:
        raise IntegrityError(
            f"re-packing {revision} from {frozen_path} gave content {index.content_digest}, "
            f"the policy record says {registered.policy.content_digest}: its frozen files are "
            "not what was registered; release a new revision instead"
        )
    log.info("exported %s again from its frozen files (%s)", revision, frozen_path)
    store.put(packed_dir, index.content_digest)
    return True


@task(
    name="catalog-snapshot",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=1,
    retry_condition_fn=transient,
)
def snapshot_catalog(config: MintConfig) -> Snapshot:
    """Publish the whole registry as the catalog snapshot workers start from, keeping the newest
    `config.catalog_snapshots`."""
    registry = Registry(config.tracking_uri)
    folder = config.work_root / "catalog"
    return build_snapshot(registry, open_store(config), folder, config.catalog_snapshots)
