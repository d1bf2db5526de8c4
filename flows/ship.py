"""Shipping an adapter's files as the next revision of an adapter: freeze -> pack -> export ->
register. Where the revision goes next is the caller's: a release rolls it out to `production`
(`flows.rollout`), the RL flow moves its `rl` alias to it."""

from dataclasses import dataclass

from flows.rollout import StageClock
from mint_core.access import EVERYONE
from mint_core.config import MintConfig
from mint_core.model.datasets import Dataset
from mint_core.model.imports import ImportedAdapter
from mint_core.model.training import TrainedAdapter
from mint_core.registry import StageMark
from mint_core.revisions import RevisionId, RevisionRef
from mint_core.states import Stage
from tasks.pipeline import export_adapter, freeze_adapter, pack_adapter, register_revision


@dataclass(frozen=True)
class Shipment:
    """What to ship, and what its policy record says of it."""

    adapter: str
    source: TrainedAdapter | ImportedAdapter
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


def ship(config: MintConfig, shipment: Shipment, timed: StageClock) -> RevisionId:
    """The next revision of `shipment.adapter`, registered (no user reaches it yet), its stage
    history starting with each step here and when it was done."""
    reached = [StageMark.reached(Stage.TRAINED, _made(shipment.source))]
    frozen = timed("freeze", freeze_adapter, config, shipment.source.path)
    reached.append(StageMark.reached(Stage.FROZEN, f"files {frozen.digest}"))
    packed_dir, index = timed("pack", pack_adapter, config, frozen)
    reached.append(StageMark.reached(Stage.PACKED, f"{len(index.shards)} shards"))
    exported = timed("export", export_adapter, config, packed_dir, index)
    reached.append(StageMark.reached(Stage.EXPORTED, exported.uri))
    return timed(
        "register",
        register_revision,
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
        reached=tuple(reached),
    )


def _made(source: TrainedAdapter | ImportedAdapter) -> str:
    """How the adapter came to be, for its `trained` entry."""
    if isinstance(source, TrainedAdapter):
        return f"{source.steps} steps on {source.dataset}"
    return f"trained elsewhere; imported from {source.path}"
