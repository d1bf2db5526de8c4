"""The steps that put a registered revision in front of users, on the workers that are to hold
it: admit, prewarm (wait until each reports it ready), activate.

Those workers (`Fleet`) are the revision's placement over the live workers of its base
(`mint_core.planning.placement`, the same function the workers and the gateway use), the
workers that already hold it or tried to, and, when the adapter's `production` revision is
ready on other workers, those too: the alias move then finds the new revision ready wherever
the old one served, and causes no cold misses. Working them out takes a registry read (two with
MINT_FLEET=registry: who announces itself) and every worker's `/health`: it is done once per
roll-out, by the admit step (with its retries), which returns it, and passed to each later
step. A step called without one (a test, a benchmark) works it out.
"""

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from prefect import task
from prefect.cache_policies import NO_CACHE

from mint_core.config import READY_TIMEOUT_S, MintConfig
from mint_core.errors import NotFoundError, NotReadyError, ServiceError
from mint_core.membership import current_fleet
from mint_core.planning.placement import place
from mint_core.registry import Registry, RolloutSlot, check_activatable
from mint_core.revisions import CANDIDATE, PRODUCTION, RevisionId, RevisionRef
from mint_core.states import Readiness, Stage
from serving.http.client import WorkerClient
from tasks.policies import transient
from tasks.runs import run_log

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fleet:
    """The workers that are to hold one revision: only they admit and prewarm it, and only
    they are waited for."""

    base_digest: str
    workers: tuple[WorkerClient, ...]


def resolve_fleet(config: MintConfig, revision: RevisionId) -> Fleet:
    """The workers of the fleet (`mint_core.membership.current_fleet`) that are to hold
    `revision`: its placement over the live workers of its base (a worker names its base in
    `/health`; one that does not answer is not live),
    the workers that hold it already or tried to (a repair retries it there), and those where
    the adapter's production revision is ready. NotReadyError if no live worker serves the
    base."""
    registry = Registry(config.tracking_uri)
    policy = registry.revisions.get(revision).policy
    urls = current_fleet(config, registry)

    def serves_base(url: str) -> WorkerClient | None:
        worker = WorkerClient(url, config.worker_api_key)
        try:
            if worker.health()["base_digest"] == policy.base_digest:
                return worker
        except ServiceError as e:
            log.warning("leaving out worker %s, which did not answer: %s", url, e)
        return None

    # All at once: a worker that does not answer costs its timeout once, not once per worker.
    with ThreadPoolExecutor(max_workers=min(16, len(urls))) as pool:
        answers = zip(urls, pool.map(serves_base, urls), strict=True)
        live = {url: worker for url, worker in answers if worker is not None}
    if not live:
        raise NotReadyError(
            f"no worker of the fleet ({', '.join(urls)}) that answers serves the base of "
            f"{revision}, {policy.base_model_id} ({policy.base_digest}): start one with "
            "MINT_BASE_MODEL set to that base, and add its URL to MINT_WORKER_URLS (or, with "
            "MINT_FLEET=registry, let it announce itself)"
        )
    replicas = registry.gates.of(revision.adapter).replicas or config.replicas
    targets = set(place(str(revision), list(live), replicas))
    serving = _production(registry, revision)
    for url, worker in live.items():
        if url in targets:
            continue
        if worker.readiness(revision)[0] is not Readiness.NOT_ADMITTED:
            targets.add(url)  # it holds the revision, or tried to (a repair retries it there)
        elif serving not in (None, revision) and worker.readiness(serving)[0] is Readiness.READY:
            targets.add(url)
    return Fleet(policy.base_digest, tuple(live[url] for url in sorted(targets)))


def _production(registry: Registry, revision: RevisionId) -> RevisionId | None:
    try:
        return registry.revisions.resolve(RevisionRef(revision.adapter, alias=PRODUCTION)).id
    except NotFoundError:
        return None


def fleet_for(config: MintConfig, revision: RevisionId, fleet: Fleet | None = None) -> Fleet:
    """`fleet` when the caller resolved it already, else `revision`'s, resolved now."""
    return resolve_fleet(config, revision) if fleet is None else fleet


@task(
    name="admit",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=1,
    retry_condition_fn=transient,
)
def admit_revision(
    config: MintConfig,
    revision: RevisionId,
    rollback: bool = False,
    fleet: Fleet | None = None,
    actor: str = "mint",
) -> Fleet:
    """Make `revision` the adapter's `candidate` (workers of its placement that restart take it
    in again) and queue it on the workers that are to hold it; a rollback goes to the front of
    their queues. The fleet that took it in (`fleet`, else resolved here): the roll-out's later
    steps use it. `actor`: who rolls it out, recorded on the stage change."""
    fleet = fleet_for(config, revision, fleet)
    registry = Registry(config.tracking_uri)
    registry.aliases.point(revision, CANDIDATE)
    for worker in fleet.workers:
        worker.admit(revision, "rollback" if rollback else "normal")
    registry.stages.set(revision, Stage.ADMITTED, actor)
    return fleet


@task(
    name="readmit",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=1,
    retry_condition_fn=transient,
)
def readmit_revision(config: MintConfig, revision: RevisionId, fleet: Fleet | None = None) -> Fleet:
    """Queue `revision` again on the workers that are to hold it, ahead of anything else: one
    that failed it takes it again, one that has it ready keeps it. Its stage and aliases stay as
    they are. The fleet that took it in, as `admit_revision`."""
    fleet = fleet_for(config, revision, fleet)
    for worker in fleet.workers:
        worker.admit(revision, "rollback")
    return fleet


@task(name="prewarm", cache_policy=NO_CACHE)
def prewarm_revision(
    config: MintConfig,
    revision: RevisionId,
    timeout_s: float = READY_TIMEOUT_S,
    fleet: Fleet | None = None,
    actor: str = "mint",
) -> None:
    """Wait until every worker that is to hold `revision` reports it ready, its stage
    `prewarming` meanwhile and `ready` after, both recorded as `actor`'s."""
    registry = Registry(config.tracking_uri)
    registry.stages.set(revision, Stage.PREWARMING, actor)
    wait_fleet_ready(config, revision, timeout_s, fleet)
    registry.stages.set(revision, Stage.READY, actor, "every worker reports it ready")


def wait_fleet_ready(
    config: MintConfig, revision: RevisionId, timeout_s: float, fleet: Fleet | None = None
) -> None:
    """Return once every worker that is to hold `revision` reports it ready; NotReadyError
    naming each worker that failed it, never admitted it, or ran out of time."""
    problems = []
    for worker in fleet_for(config, revision, fleet).workers:
        try:
            worker.wait_ready(revision, timeout_s)
        except NotReadyError as e:
            problems.append(str(e))
    if problems:
        raise NotReadyError(f"{revision} is not ready on the fleet: {'; '.join(problems)}")


@task(name="activate", cache_policy=NO_CACHE)
def activate_revision(
    config: MintConfig,
    revision: RevisionId,
    alias: str = PRODUCTION,
    actor: str = "mint",
    reason: str = "release",
    timeout_s: float = READY_TIMEOUT_S,
    approver: str = "",
    fleet: Fleet | None = None,
    *,
    slot: RolloutSlot,
) -> None:
    """Move `alias` to `revision` once every worker that is to hold it reports it ready
    (waiting up to `timeout_s`); if one fails it or time runs out, the alias stays where it
    was. The workers are nudged as soon as the alias has moved, so they switch new requests at
    once instead of at their next sync, and again once the roll-out's records are finished
    (the candidate alias dropped, the stages moved). `approver` (who approved this roll-out, if
    its gates asked) is recorded on the move. `slot`: the adapter's roll-out slot, held
    (`tasks.pipeline.rollout_lock`)."""
    slot.check(revision.adapter)  # at once, not after the wait for the fleet
    registry = Registry(config.tracking_uri)
    check_activatable(registry.revisions.get(revision))
    try:
        wait_fleet_ready(config, revision, timeout_s, fleet)
    except NotReadyError as e:
        raise NotReadyError(f"not moving {revision.adapter}@{alias} to {revision}: {e}") from e
    # Read again after the wait (minutes, perhaps): the activation writes on from this record.
    registered = registry.revisions.get(revision)
    check_activatable(registered)
    previous = registry.aliases.activate(
        registered, alias, actor, reason, approver, lambda: nudge_workers(config), slot=slot
    )
    before = "none" if previous is None else f"r{previous}"
    run_log().info("%s@%s %s → r%d (%s)", revision.adapter, alias, before, revision.number, reason)
    nudge_workers(config)


def nudge_workers(config: MintConfig) -> None:
    """Have every worker of the fleet (every base's: one that does not serve the adapter syncs
    fast) catch up with the registry now, all at once: the slowest, not their sum, is how long
    users wait for an alias move. A worker that does not answer catches up at its next sync."""

    def nudge(url: str) -> None:
        try:
            WorkerClient(url, config.worker_api_key).sync()
        except ServiceError as e:
            log.warning("could not nudge worker %s to sync: %s", url, e)

    urls = current_fleet(config)
    if len(urls) <= 1:  # no thread for the common case
        for url in urls:
            nudge(url)
        return
    with ThreadPoolExecutor(max_workers=min(16, len(urls))) as pool:
        list(pool.map(nudge, urls))
