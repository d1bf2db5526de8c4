"""The steps that turn an adapter's files into a registered revision: freeze, pack, export,
register; and export again, from the frozen files, a revision whose artifact was lost."""

import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from mint_core.access import EVERYONE
from mint_core.artifacts.freezing import FrozenAdapter, freeze
from mint_core.artifacts.packing import DEFAULT_SHARD_BYTES, PackedIndex, pack
from mint_core.artifacts.reexport import check_repacked, frozen_files
from mint_core.artifacts.stores import open_store
from mint_core.config import MintConfig
from mint_core.errors import NotFoundError
from mint_core.model.base import identity
from mint_core.model.datasets import Dataset
from mint_core.model.imports import ImportedAdapter
from mint_core.model.training import TrainedAdapter
from mint_core.planning.evaluation import EVAL_ROWS_TAG, TRAIN_ROWS_TAG, store_digests, store_rows
from mint_core.registry import Registry, StageMark
from mint_core.revisions import PolicyRecord, RevisionId, RevisionRef
from tasks.policies import ONCE_PER_RUN, transient
from tasks.runs import run_log

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Exported:
    uri: str
    content_digest: str


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
# `reached` (the steps' times) is left out of the cache key: a rerun reuses the revision.
@task(name="register", cache_policy=ONCE_PER_RUN - "reached", persist_result=True)
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
    trained_on: Dataset | None = None,
    reached: tuple[StageMark, ...] = (),
) -> RevisionId:
    """Register the next revision of `adapter`, with the `held_out` rows a trained one was
    evaluated on kept in the artifact store: its evaluation gate, and later candidates', score
    on them; and the digests of the rows it was `trained_on`, which no gate scores it on. Its
    parent is the revision `parent` names (a release's is `adapter@production`, an RL sync's
    the revision it trained from), if that resolves to one. `reached`: the steps before
    (trained, frozen, packed, exported) and when: the start of its stage history."""
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
    tags = {}
    store = open_store(config)
    if held_out is not None:  # named by their content: stored again alike if this is retried
        name = store_rows(store, config.work_root / "eval-rows", held_out.rows)
        tags[EVAL_ROWS_TAG] = name  # written with the revision: never one without them
    if trained_on is not None:
        digests = (row.digest() for row in trained_on.rows)
        tags[TRAIN_ROWS_TAG] = store_digests(store, config.work_root / "eval-rows", digests)
    revision = registry.register(policy, exported.uri, serving_base, run_id, tags, reached).id
    run_log().info("registered %s (%s)", revision, exported.content_digest)
    return revision


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
    frozen files if it is missing or damaged there (`mint_core.artifacts.reexport`); whether it had
    to.
    Never retrains: with the frozen files gone it fails clearly."""
    registered = Registry(config.tracking_uri).get(revision)
    store = open_store(config)
    if store.holds(registered.artifact_uri):
        return False
    policy = registered.policy
    frozen = frozen_files(revision, policy, registered.artifact_uri, config.frozen_root)
    packed_dir, index = pack_adapter.fn(config, frozen, shard_bytes)
    check_repacked(revision, policy, frozen, index)
    log.info("exported %s again from its frozen files (%s)", revision, frozen.path)
    store.put(packed_dir, index.content_digest)
    return True
