"""Repair: serve an existing revision from intact bytes again, moving no alias and no stage.

repair = (export again from its frozen files if its artifact is missing or damaged in the
store) -> re-admit it on every worker, ahead of their queues -> wait until each reports it
ready.

It is what an error about a damaged artifact points at (`mint repair --adapter NAME --revision
N`): `promote` refuses a revision that is already production, and a worker that failed a
revision takes it again only when it is admitted again.
"""

from dataclasses import dataclass

from prefect import flow

from flows.ending import ends_on_mint_error
from mint_core.catalog.catalog import SERVED_ALIASES
from mint_core.config import READY_TIMEOUT_S, MintConfig
from mint_core.registry import Registry
from mint_core.revisions import RevisionId, check_adapter_name
from tasks.pipeline import ensure_exported, readmit_revision, rollout_lock, wait_fleet_ready
from tasks.runs import label_run, summarize


@dataclass(frozen=True)
class RepairReport:
    """What a repair did."""

    revision: str
    exported_again: bool
    """Whether its artifact was missing or damaged and was exported again from frozen files."""
    workers: int
    """How many workers took it in again and report it ready; 0 when no alias that workers
    hold (production, candidate) names it, as then none should hold it."""


@flow(name="repair", flow_run_name="repair {adapter} r{revision}")
@ends_on_mint_error
def repair(
    adapter: str, revision: int, actor: str = "mint", reason: str = "repair"
) -> RepairReport:
    """Make `adapter:r<revision>` servable from an intact artifact again: export it again from
    its frozen files if it is missing or damaged in the store; then, if workers should hold it
    (production or candidate names it), re-admit it on every worker and wait until each reports
    it ready. Aliases and stage stay as they are; its stage history records the repair.

    Args:
        adapter: The adapter, e.g. `support-bot`.
        revision: The number N of the revision `adapter:rN` to repair.
        actor: Your name: recorded in its stage history as who repaired it.
        reason: Why; recorded in its stage history.
    """
    config = MintConfig.from_env()
    label_run(check_adapter_name(adapter))
    target = RevisionId(adapter, revision)
    registry = Registry(config.tracking_uri)
    held = [alias for alias in registry.revisions.get(target).aliases if alias in SERVED_ALIASES]
    exported_again = ensure_exported(config, target)
    workers = 0
    if held:
        with rollout_lock(adapter):
            serving = readmit_revision(config, target)
            wait_fleet_ready(config, target, READY_TIMEOUT_S, serving)
        workers = len(serving.workers)
    report = RepairReport(str(target), exported_again, workers)
    artifact = "exported again from its frozen files" if exported_again else "artifact intact"
    fleet = f"ready again on {report.workers} workers" if held else "no worker should hold it"
    registry.stages.note(target, actor, f"{reason}: {artifact}; {fleet}")
    summarize(adapter, f"repaired {target}", {"artifact": artifact, "fleet": fleet})
    return report
