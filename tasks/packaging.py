"""The shipping steps of `mint_core.shipping` as Prefect tasks: freeze, pack, export, register,
and ensure-exported (export again, from the frozen files, a revision whose artifact was lost).
`SHIP_TASKS` are the four that `shipping.ship` runs in a flow."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from prefect import task
from prefect.cache_policies import NO_CACHE

from mint_core import shipping
from mint_core.access import EVERYONE
from mint_core.artifacts.freezing import FrozenAdapter
from mint_core.artifacts.packed_index import DEFAULT_SHARD_BYTES, PackedIndex
from mint_core.config import MintConfig
from mint_core.model.datasets import Dataset
from mint_core.registry import StageMark
from mint_core.revisions import RevisionId, RevisionRef
from mint_core.shipping import Exported
from tasks.policies import ONCE_PER_RUN, handed_whole, transient
from tasks.runs import run_log

if TYPE_CHECKING:  # torch and PEFT, for types only: promotions and rollbacks run ensure-exported
    from mint_core.model.imports import ImportedAdapter
    from mint_core.model.training import TrainedAdapter


@task(name="freeze", cache_policy=NO_CACHE)
def freeze_adapter(config: MintConfig, adapter_dir: Path) -> FrozenAdapter:
    return shipping.freeze_adapter(config, adapter_dir)


@task(name="pack", cache_policy=NO_CACHE)
def pack_adapter(
    config: MintConfig, frozen: FrozenAdapter, shard_bytes: int = DEFAULT_SHARD_BYTES
) -> tuple[Path, PackedIndex]:
    return shipping.pack_adapter(config, frozen, shard_bytes)


@task(
    name="export",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=1,
    retry_condition_fn=transient,
)
def export_adapter(config: MintConfig, packed_dir: Path, index: PackedIndex) -> Exported:
    return shipping.export_adapter(config, packed_dir, index)


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
    revision = shipping.register_revision(
        config, adapter, source, frozen, exported, actor, principals, held_out, parent,
        trained_on, reached,
    )  # fmt: skip
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
    return shipping.ensure_exported(config, revision, shard_bytes)


SHIP_TASKS = shipping.Steps(
    freeze_adapter, pack_adapter, export_adapter, handed_whole(register_revision)
)
"""`shipping.ship`'s steps as the tasks above (register takes the datasets it records)."""
