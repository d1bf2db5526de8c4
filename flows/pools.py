"""Flow runs on other hosts: `mint flows deploy` puts each deployment in its Prefect process
work pool (`Pool`: the flows that train to MINT_TRAIN_POOL, the others to MINT_CONTROL_POOL),
and each host runs `prefect worker start` on its pool (`control.services.start_prefect_worker`,
which `mint up --role control|train` runs). A run then starts as a subprocess of the worker that
took it, with that host's environment: MinT's configuration is the host's own. `mint flows
serve` stays the one-machine way, with no pool.

Nothing marks a run Crashed when its host, or its worker with it, dies (Prefect's foreman only
marks the worker offline), so the runs of the pools' deployments send a heartbeat every
`CrashWatch.heartbeat_s` (set in their environment by the deployment) and an automation marks a
run Crashed once none has come for `crash_after_s` and it has not ended. A train host's worker
also polls a work queue of its own (`control.services.host_queue`), so that a run can be sent
to one host. A gated release waits for its approval inside its own run, after training, so it
holds its train host's one slot until answered or `Gates.approval_timeout_s` passes: the price
of one run (and one record) per release, whoever starts it; give gated adapters a timeout of
hours, not the default day.
"""

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from uuid import UUID

from prefect import get_client
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterTags
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState
from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
from prefect.events.schemas.events import ResourceSpecification
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from flows.deployments import Pool, deployments_by_pool
from mint_core.config import MintConfig
from mint_core.errors import ConfigurationError

POOL_TAG = "pool:{}"
"""The tag of every deployment in a work pool (and so of its runs): the runs list filters on
it, and the crash automation watches only the runs that carry one of MinT's."""

AUTOMATION = "mint: crash flow runs whose heartbeats stop"
"""The crash automation's name: `deploy_to_pools` replaces the one of that name."""

PREFECT_MIN_HEARTBEAT_S = 30
"""Prefect's floor for PREFECT_FLOWS_HEARTBEAT_FREQUENCY (its default is 180 s)."""

TERMINAL_EVENTS = frozenset(
    f"prefect.flow-run.{state}" for state in ("Completed", "Failed", "Cancelled", "Crashed")
)
"""A run that reached one of these states sends no more heartbeats, rightly. A run paused for
approval keeps sending them: it waits in its own process (`pause_flow_run`), whose heartbeat
thread stops only at a final state."""


@dataclass(frozen=True)
class CrashWatch:
    """How soon a flow run whose host died is marked Crashed."""

    heartbeat_s: int = PREFECT_MIN_HEARTBEAT_S
    """How often a run of a pool's deployment says it is alive."""
    crash_after_s: int = 3 * PREFECT_MIN_HEARTBEAT_S
    """How long after its last heartbeat a run that has not ended is marked Crashed: two
    heartbeats and a margin, since a heartbeat thread may starve on a busy host (a training
    run on 2 cores) and the automation itself is checked every few seconds."""

    def __post_init__(self) -> None:
        if self.heartbeat_s < PREFECT_MIN_HEARTBEAT_S:
            raise ConfigurationError(
                f"heartbeat every {self.heartbeat_s} s: Prefect allows no less than "
                f"{PREFECT_MIN_HEARTBEAT_S} s"
            )
        if self.crash_after_s <= self.heartbeat_s:
            raise ConfigurationError(
                f"crash after {self.crash_after_s} s without a heartbeat would crash healthy "
                f"runs, which beat every {self.heartbeat_s} s: give at least twice that"
            )

    def run_env(self) -> dict[str, str]:
        """The environment a pool's flow run gets on top of its worker's."""
        return {
            "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(self.heartbeat_s),
            # With `uv` on PATH and a project folder as the worker's working directory, Prefect
            # would start each run with `uv run`, syncing that project's dependencies first.
            "PREFECT_RUNNER_AUTO_INSTALL_DEPENDENCIES": "false",
        }


@dataclass(frozen=True)
class Deployed:
    """What `deploy_to_pools` put in place."""

    deployments: Mapping[str, tuple[str, ...]]
    """Each work pool's deployments, as `flow/deployment` names."""
    deployment_ids: tuple[UUID, ...]
    automation_id: UUID
    removed: tuple[str, ...] = ()
    """Deployments an earlier deploy made that this one no longer has, deleted."""
    watch: CrashWatch = field(default_factory=CrashWatch)


def deploy_to_pools(config: MintConfig, watch: CrashWatch = CrashWatch()) -> Deployed:
    """Create the work pools that are missing (process pools), put every deployment in its
    pool, and install (or replace) the crash automation, on the Prefect server this process
    points at (PREFECT_API_URL). Deploying again updates each deployment in place and deletes
    those of its pools it no longer has (`remove_stale`)."""
    with get_client(sync_client=True) as client:
        for pool in Pool:
            ensure_pool(client, pool.work_pool(config))
    names: dict[str, tuple[str, ...]] = {}
    ids: list[UUID] = []
    for pool, deployments in deployments_by_pool(config).items():
        work_pool = pool.work_pool(config)
        for deployment in deployments:
            deployment.tags = [*deployment.tags, POOL_TAG.format(work_pool)]
            deployment.job_variables = {"env": watch.run_env()}
            # What `prefect.deploy` does per deployment, without its console table, and
            # raising the first failure rather than printing it.
            ids.append(deployment.apply(work_pool_name=work_pool))
        names[work_pool] = tuple(f"{d.flow_name}/{d.name}" for d in deployments)
    with get_client(sync_client=True) as client:
        removed = remove_stale(client, config, set(ids))
        automation_id = install_crash_automation(client, config, watch)
    return Deployed(names, tuple(ids), automation_id, removed, watch)


def remove_stale(client: SyncPrefectClient, config: MintConfig, kept: set[UUID]) -> tuple[str, ...]:
    """Delete the deployments an earlier deploy put in MinT's pools that this one did not (a
    schedule since taken out of MINT_RETRAIN would go on starting runs); their names."""
    tags = [POOL_TAG.format(pool.work_pool(config)) for pool in Pool]
    found = client.read_deployments(
        deployment_filter=DeploymentFilter(tags=DeploymentFilterTags(any_=tags))
    )
    stale = [deployment for deployment in found if deployment.id not in kept]
    for deployment in stale:
        client.delete_deployment(deployment.id)
    return tuple(sorted(deployment.name for deployment in stale))


def ensure_pool(client: SyncPrefectClient, name: str) -> None:
    """Create process work pool `name` unless a pool of that name exists (of any type: one
    made by hand, e.g. a Kubernetes pool, is kept as it is)."""
    try:
        client.read_work_pool(name)
    except ObjectNotFound:
        # Another host's `mint flows deploy` may make it meanwhile.
        with contextlib.suppress(ObjectAlreadyExists):
            client.create_work_pool(WorkPoolCreate(name=name, type="process"))


def crash_automation(config: MintConfig, watch: CrashWatch) -> AutomationCore:
    """After a heartbeat of a run of MinT's pools, expect another or a final state within
    `watch.crash_after_s`; when neither comes, mark that run Crashed."""
    pools = [POOL_TAG.format(pool.work_pool(config)) for pool in Pool]
    tags = [f"prefect.tag.{tag}" for tag in pools]
    trigger = EventTrigger(
        after={"prefect.flow-run.heartbeat"},
        expect={"prefect.flow-run.heartbeat", *TERMINAL_EVENTS},
        match=ResourceSpecification({"prefect.resource.id": "prefect.flow-run.*"}),
        # Only runs of the pools' deployments are sure to beat this often (`run_env`).
        match_related=ResourceSpecification(
            {"prefect.resource.role": "tag", "prefect.resource.id": tags}
        ),
        for_each={"prefect.resource.id"},
        posture=Posture.Proactive,
        threshold=1,
        within=timedelta(seconds=watch.crash_after_s),
    )
    return AutomationCore(
        name=AUTOMATION,
        description=(
            f"A run of {' or '.join(pools)} whose heartbeats (every {watch.heartbeat_s} s) stop "
            f"for {watch.crash_after_s} s before it ends: its host or its worker died."
        ),
        trigger=trigger,
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"no heartbeat for {watch.crash_after_s} s: its host or worker died",
            )
        ],
    )


def install_crash_automation(
    client: SyncPrefectClient, config: MintConfig, watch: CrashWatch
) -> UUID:
    """The crash automation, replacing any of the same name (an earlier deploy's settings)."""
    for existing in client.read_automations_by_name(AUTOMATION):
        client.delete_automation(existing.id)
    return client.create_automation(crash_automation(config, watch))
