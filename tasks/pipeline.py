"""The release pipeline's steps as Prefect tasks, one module per stage, each a thin call into
mint_core (or, for the fleet steps, into the workers' HTTP API). This module gathers those that
every roll-out uses; the steps that make an adapter (`tasks.training`: load-data, train,
check-import) are imported by the flows that train, from their module: they bring torch and
PEFT, which a promotion, a rollback or any flow of the control pool never loads (issue 48: a
rollback's process spent 6.7 s of its ~23 s importing them).

- `tasks.packaging`: freeze, pack, export, register (`SHIP_TASKS`), ensure-exported
- `tasks.fleet`: admit, readmit, prewarm, activate, on the `Fleet` of the revision's base
- `tasks.evaluation`: evaluate
- `tasks.catalog`: catalog-snapshot

Prefect's own mechanisms do the operational work: retries on the steps that cross the network
(`tasks.policies.transient`), persisted results keyed by flow run for the expensive steps (a
rerun of a failed run, such as "Retry" in the Prefect UI, skips training and reuses the
revision it already registered), and a strict global concurrency limit per adapter around
rolling a revision out (`rollout_lock`, here).
"""

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress

from prefect import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from mint_core.errors import RolloutBusyError
from mint_core.registry import RolloutSlot, held_slot
from mint_core.shipping import Exported
from tasks.catalog import snapshot_catalog
from tasks.evaluation import evaluate_revision
from tasks.fleet import (
    Fleet,
    activate_revision,
    admit_revision,
    fleet_for,
    prewarm_revision,
    readmit_revision,
    resolve_fleet,
    wait_fleet_ready,
)
from tasks.packaging import (
    SHIP_TASKS,
    ensure_exported,
    export_adapter,
    freeze_adapter,
    pack_adapter,
    register_revision,
)
from tasks.policies import transient

__all__ = [
    "ROLLOUT_TIMEOUT_S",
    "SHIP_TASKS",
    "Exported",
    "Fleet",
    "activate_revision",
    "admit_revision",
    "ensure_exported",
    "evaluate_revision",
    "export_adapter",
    "fleet_for",
    "freeze_adapter",
    "pack_adapter",
    "prewarm_revision",
    "readmit_revision",
    "register_revision",
    "resolve_fleet",
    "rollout_lock",
    "snapshot_catalog",
    "transient",
    "wait_fleet_ready",
]


ROLLOUT_TIMEOUT_S = 900.0
"""How long a roll-out waits for another roll-out of the same adapter to finish."""


@contextmanager
def rollout_lock(adapter: str, timeout_s: float | None = None) -> Iterator[RolloutSlot]:
    """Hold `adapter`'s roll-out slot: a strict Prefect global concurrency limit of 1, so no
    two releases, promotions, rollbacks, canaries, RL syncs or repairs of one adapter admit and
    move its aliases at once, in any process. Yields the slot as a value
    (`mint_core.registry.RolloutSlot`): every alias move requires it, so none can happen
    outside this block. The limit is created on first use. A holder that dies frees the slot
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
        with held_slot(adapter, name) as slot:
            yield slot
