"""Shipping: an adapter's files become the next registered revision of its adapter (freeze ->
pack -> export -> register), and a revision whose artifact was lost is exported again from its
frozen files. No user reaches a shipped revision yet: where it goes next (a roll-out to
`production`, the RL flow's `rl` alias) is the caller's.

`ship` runs the four steps in order. The release and RL flows pass the Prefect tasks that wrap
them (`tasks.packaging.SHIP_TASKS`: retries, cached results, run logs); the trainer runs them as
plain functions (`DIRECT`).

Promotions and rollbacks import this module too (`ensure_exported`), on control hosts that
train nothing: it loads no tensor library. The packer is imported when it packs, and the
adapters shipped are named here for their types only."""

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, ParamSpec, Protocol, TypeVar

from mint_core.access import EVERYONE
from mint_core.artifacts.freezing import FrozenAdapter, freeze
from mint_core.artifacts.packed_index import DEFAULT_SHARD_BYTES, PackedIndex
from mint_core.artifacts.reexport import check_repacked, frozen_files
from mint_core.artifacts.stores import open_store
from mint_core.config import MintConfig
from mint_core.errors import NotFoundError
from mint_core.model.base import identity
from mint_core.model.datasets import Dataset
from mint_core.planning.evaluation import EVAL_ROWS_TAG, TRAIN_ROWS_TAG, store_digests, store_rows
from mint_core.registry import Registry, StageMark
from mint_core.revisions import PolicyRecord, RevisionId, RevisionRef
from mint_core.states import Stage

if TYPE_CHECKING:  # torch and PEFT, for types only
    from mint_core.model.imports import ImportedAdapter
    from mint_core.model.training import TrainedAdapter

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class Exported:
    """A packed adapter in the artifact store."""

    uri: str
    content_digest: str


@dataclass(frozen=True)
class Shipment:
    """What to ship, and what its policy record says of it."""

    adapter: str
    source: "TrainedAdapter | ImportedAdapter"
    actor: str
    """Who ships it: recorded as who created it."""
    principals: tuple[str, ...] = (EVERYONE,)
    """Who may use it."""
    held_out: Dataset | None = None
    """The rows a trained revision was evaluated on: kept for evaluation gates."""
    parent: RevisionRef | None = None
    """The revision it descends from, if this resolves to one."""
    trained_on: Dataset | None = None
    """The rows a trained revision learned from: recorded by digest, so no evaluation gate
    scores it on them."""


def freeze_adapter(config: MintConfig, adapter_dir: Path) -> FrozenAdapter:
    return freeze(adapter_dir, config.frozen_root)


def pack_adapter(
    config: MintConfig, frozen: FrozenAdapter, shard_bytes: int = DEFAULT_SHARD_BYTES
) -> tuple[Path, PackedIndex]:
    # The packer (torch) on first use: a promotion re-packs only an artifact that was lost.
    from mint_core.artifacts.packing import pack

    out_dir = config.work_root / "packed" / frozen.digest.removeprefix("sha256:")
    return out_dir, pack(frozen, out_dir, shard_bytes)


def export_adapter(config: MintConfig, packed_dir: Path, index: PackedIndex) -> Exported:
    store = open_store(config)
    return Exported(store.put(packed_dir, index.content_digest), index.content_digest)


def register_revision(
    config: MintConfig,
    adapter: str,
    source: "TrainedAdapter | ImportedAdapter",
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
    revisions = Registry(config.tracking_uri).revisions
    try:
        parent_number = revisions.resolve(parent).id.number if parent else None
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
    tags = {}
    store = open_store(config)
    if held_out is not None:  # named by their content: stored again alike if this is retried
        name = store_rows(store, config.work_root / "eval-rows", held_out.rows)
        tags[EVAL_ROWS_TAG] = name  # written with the revision: never one without them
    if trained_on is not None:
        digests = (row.digest() for row in trained_on.rows)
        tags[TRAIN_ROWS_TAG] = store_digests(store, config.work_root / "eval-rows", digests)
    revision = revisions.register(
        policy, exported.uri, serving_base, source.run_id, tags, reached
    ).id
    log.info("registered %s (%s)", revision, exported.content_digest)
    return revision


def ensure_exported(
    config: MintConfig, revision: RevisionId, shard_bytes: int = DEFAULT_SHARD_BYTES
) -> bool:
    """Make sure the revision's artifact is intact in the store, exporting it again from its
    frozen files if it is missing or damaged there (`mint_core.artifacts.reexport`); whether it
    had to. Never retrains: with the frozen files gone it fails clearly."""
    registered = Registry(config.tracking_uri).revisions.get(revision)
    store = open_store(config)
    if store.holds(registered.artifact_uri):
        return False
    policy = registered.policy
    frozen = frozen_files(revision, policy, registered.artifact_uri, config.frozen_root)
    packed_dir, index = pack_adapter(config, frozen, shard_bytes)
    check_repacked(revision, policy, frozen, index)
    log.info("exported %s again from its frozen files (%s)", revision, frozen.path)
    store.put(packed_dir, index.content_digest)
    return True


@dataclass(frozen=True)
class Steps:
    """The four steps `ship` runs, each with the signature of the function here it names."""

    freeze: Callable[[MintConfig, Path], FrozenAdapter]
    """`freeze_adapter`"""
    pack: Callable[[MintConfig, FrozenAdapter], tuple[Path, PackedIndex]]
    """`pack_adapter`"""
    export: Callable[[MintConfig, Path, PackedIndex], Exported]
    """`export_adapter`"""
    register: Callable[..., RevisionId]
    """`register_revision`, called with its parameters' names."""


DIRECT = Steps(freeze_adapter, pack_adapter, export_adapter, register_revision)
"""The steps as plain functions."""


class StepClock(Protocol):
    """Runs one step of `ship` under its stage's name (freeze, pack, export, register), e.g.
    timing it (`flows.rollout.StageClock`)."""

    def __call__(
        self, stage: str, step: Callable[P, R], *args: P.args, **kwargs: P.kwargs
    ) -> R: ...


def untimed(stage: str, step: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """A `StepClock` that only runs the step."""
    return step(*args, **kwargs)


def ship(
    config: MintConfig,
    shipment: Shipment,
    steps: Steps = DIRECT,
    timed: StepClock = untimed,
    record_steps: bool = True,
) -> RevisionId:
    """The next revision of `shipment.adapter`, registered (no user reaches it yet), its stage
    history starting with each step here and when it was done. Without `record_steps` its
    history starts at `registered`: the trainer's sampler revisions have always begun there."""
    reached = [StageMark.reached(Stage.TRAINED, shipment.source.made())]
    frozen = timed("freeze", steps.freeze, config, shipment.source.path)
    reached.append(StageMark.reached(Stage.FROZEN, f"files {frozen.digest}"))
    packed_dir, index = timed("pack", steps.pack, config, frozen)
    reached.append(StageMark.reached(Stage.PACKED, f"{len(index.shards)} shards"))
    exported = timed("export", steps.export, config, packed_dir, index)
    reached.append(StageMark.reached(Stage.EXPORTED, exported.uri))
    return timed(
        "register",
        steps.register,
        config=config,
        adapter=shipment.adapter,
        source=shipment.source,
        frozen=frozen,
        exported=exported,
        actor=shipment.actor,
        principals=shipment.principals,
        held_out=shipment.held_out,
        parent=shipment.parent,
        trained_on=shipment.trained_on,
        reached=tuple(reached) if record_steps else (),
    )
