"""The canary: a candidate takes a share of `name@production`'s live requests for a window,
then is promoted or rolled back on the figures, with no one watching.

admit -> prewarm (every worker of the base) -> `canary` alias + share -> watch -> verdict:
promote (through the approval gate, if the adapter requires one) or roll back (the share goes
back to production and the candidate is `rejected`). Both decisions, with the figures that led
to them, are in the adapter's alias history and the flow run's artifacts.
"""

import contextlib
import time
from dataclasses import dataclass

from prefect import flow
from prefect.artifacts import create_table_artifact

from flows.approval import await_approval
from flows.ending import ends_on_mint_error
from flows.rollout import take_in
from mint_core.config import CANARY_MIN_REQUESTS, CANARY_PERCENT, CANARY_WINDOW_S, MintConfig
from mint_core.errors import ConfigurationError, MintError, NotFoundError, RejectedError
from mint_core.planning.canary_judge import RevisionOutcomes, judge, merge
from mint_core.registry import Registry, check_canary_percent
from mint_core.revisions import PRODUCTION, RevisionId, RevisionRef, check_adapter_name
from tasks.pipeline import Fleet, activate_revision, ensure_exported, rollout_lock
from tasks.runs import label_run, production_move, summarize

POLL_S = 2.0
"""How often the watch reads the workers' figures while waiting for enough requests."""


@dataclass(frozen=True)
class CanaryReport:
    revision: str
    promoted: bool
    reason: str


@flow(name="canary", flow_run_name="canary {adapter} r{revision} at {percent}%")
@ends_on_mint_error
def canary(
    adapter: str,
    revision: int,
    percent: float = CANARY_PERCENT,
    window_s: float = CANARY_WINDOW_S,
    min_requests: int = CANARY_MIN_REQUESTS,
    actor: str = "mint",
) -> CanaryReport:
    """Send `percent`% of `adapter@production`'s requests to `adapter:r<revision>` for
    `window_s` seconds (longer, up to three windows, until it has served `min_requests`), then
    promote it or roll it back by the adapter's canary margins (`mint gates`).

    Args:
        adapter: The adapter, e.g. `support-bot`; it must have a production revision.
        revision: The number N of the candidate `adapter:rN`.
        percent: Share of production's requests the candidate answers, in percent.
        window_s: How long to watch, in seconds (up to three windows until `min_requests`).
        min_requests: Requests the candidate must serve before it is judged.
        actor: Your name: recorded as who started the canary and moved production.
    """
    config = MintConfig.from_env()
    label_run(check_adapter_name(adapter))
    candidate = RevisionId(adapter, revision)
    registry = Registry(config.tracking_uri)
    try:
        production = registry.revisions.resolve(RevisionRef(adapter)).id
    except NotFoundError as e:
        raise ConfigurationError(
            f"{adapter} has no production revision to compare a canary with; promote "
            f"{candidate} instead"
        ) from e
    if production == candidate:
        raise ConfigurationError(f"{candidate} is already {adapter}@{PRODUCTION}")
    check_canary_percent(percent)
    if min_requests < 1 or window_s <= 0:
        raise ConfigurationError(
            f"window_s={window_s} and min_requests={min_requests} must both be positive"
        )
    gates = registry.gates.of(adapter)
    ensure_exported(config, candidate)
    with rollout_lock(adapter) as slot:
        fleet = take_in(config, candidate, slot, actor)
        started = time.time()
        registry.canary.start(
            candidate, percent, actor, f"canary: {percent:g}% of {adapter}@{PRODUCTION}", slot=slot
        )
    _nudge(fleet)
    try:
        figures = _watch(fleet, candidate, production, started, window_s, min_requests)
        verdict = judge(
            figures.get(str(candidate), RevisionOutcomes.empty(str(candidate))),
            figures.get(str(production), RevisionOutcomes.empty(str(production))),
            gates,
            min_requests,
        )
        _publish(adapter, figures, (candidate, production), verdict.reason)
        approver = ""
        if verdict.promote and gates.requires_approval:
            approver = await_approval(config, candidate, gates, actor)  # RejectedError: rejected
        with rollout_lock(adapter) as slot:
            if verdict.promote:
                activate_revision(
                    config,
                    candidate,
                    PRODUCTION,
                    actor,
                    f"canary {verdict.reason}",
                    approver=approver,
                    fleet=fleet,
                    slot=slot,
                )
            registry.canary.end(adapter, actor, verdict.reason, slot=slot)
            if not verdict.promote:
                registry.aliases.reject(candidate, actor, verdict.reason)
    except BaseException as e:
        # Whatever stopped it (a worker gone, a rejected approval, Ctrl-C in `mint canary`),
        # the candidate's share goes back to production: nothing decided it should go on.
        stopped = f"stopped: {type(e).__name__}: {e}"
        # Ending it moves `canary`: in the roll-out slot like every move. A slot still busy
        # after the usual wait leaves the canary to the next `mint canary` or a rollback.
        with contextlib.suppress(MintError), rollout_lock(adapter) as slot:
            registry.canary.end(adapter, actor, stopped, slot=slot)
        if not isinstance(e, RejectedError):
            with contextlib.suppress(MintError):
                registry.stages.mark_failed(candidate, stopped, actor)
        raise
    _nudge(fleet)
    summarize(
        adapter,
        f"canary {candidate} {'promoted' if verdict.promote else 'rolled back'}",
        {"verdict": verdict.reason, "production": production_move(config, adapter)},
    )
    return CanaryReport(str(candidate), verdict.promote, verdict.reason)


def _watch(
    fleet: Fleet,
    candidate: RevisionId,
    production: RevisionId,
    since: float,
    window_s: float,
    min_requests: int,
) -> dict[str, RevisionOutcomes]:
    """The fleet's figures per revision since `since`, once the window has passed and the
    candidate has served `min_requests` (or three windows have passed)."""
    end, last_chance = since + window_s, since + 3 * window_s
    while True:
        time.sleep(POLL_S)
        now = time.time()
        if now < end:
            continue
        figures = merge(worker.outcomes(since) for worker in fleet.workers)
        served = figures.get(str(candidate))
        if (served and served.requests >= min_requests) or now >= last_chance:
            return figures


def _nudge(fleet: Fleet) -> None:
    """Have the workers follow the registry now rather than at their next sync."""
    for worker in fleet.workers:
        worker.sync()


def _publish(
    adapter: str,
    figures: dict[str, RevisionOutcomes],
    revisions: tuple[RevisionId, RevisionId],
    verdict: str,
) -> None:
    """The canary's figures as a table in the flow run's artifacts (the Prefect UI)."""
    rows = []
    for role, revision in zip(("canary", "production"), revisions, strict=True):
        outcome = figures.get(str(revision), RevisionOutcomes.empty(str(revision)))
        rows.append({"role": role, **outcome.to_json()})
    create_table_artifact(rows, key=f"canary-{adapter}", description=verdict)
