"""Shipping in a flow: `mint_core.shipping.ship`'s steps run as Prefect tasks, each timed.
Where the revision goes next is the caller's: a release rolls it out to `production`
(`flows.rollout`), the RL flow moves its `rl` alias to it."""

from flows.rollout import StageClock
from mint_core import shipping
from mint_core.config import MintConfig
from mint_core.revisions import RevisionId
from mint_core.shipping import Shipment
from tasks.pipeline import SHIP_TASKS


def ship(config: MintConfig, shipment: Shipment, timed: StageClock) -> RevisionId:
    """The next revision of `shipment.adapter`, registered (no user reaches it yet), its stage
    history starting with each step and when it was done."""
    return shipping.ship(config, shipment, SHIP_TASKS, timed)
