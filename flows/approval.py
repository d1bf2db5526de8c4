"""Approval: a roll-out of an adapter whose gates require it pauses before `activate` until an
allowed reviewer answers, in the Prefect UI (the paused run shows a form) or with
`mint approve`. Every answer, refused ones included, goes into the revision's stage history in
MLflow with its author and comment; no answer before the timeout is a rejection.
"""

import time
from enum import StrEnum
from uuid import UUID

import prefect.runtime
from prefect import flow
from prefect.exceptions import FlowPauseTimeout, NotPausedError
from prefect.flow_runs import pause_flow_run, resume_flow_run
from prefect.input import RunInput

from mint_core.config import MintConfig
from mint_core.errors import ConfigurationError, NotFoundError, RejectedError
from mint_core.gates import Gates
from mint_core.registry import APPROVAL_RUN_TAG, Registry
from mint_core.revisions import RevisionId, check_adapter_name

POLL_S = 2
"""How often a paused run looks for its answer (Prefect's default, 10 s, slows every
approval by that much)."""


class Verdict(StrEnum):
    APPROVE = "approve"
    REJECT = "reject"


class Decision(RunInput):
    """The form the Prefect UI shows on a paused roll-out."""

    decision: Verdict
    reviewer: str
    """Who answers. Prefect's open-source server does not authenticate its UI's users: the
    reviewer names themself, and the gates decide whether that name may answer."""
    comment: str = ""


def await_approval(config: MintConfig, revision: RevisionId, gates: Gates, releaser: str) -> str:
    """Pause this flow run until an approver of `revision`'s adapter answers. Returns, once
    approved, who approved (recorded on the alias move); RejectedError (stage `rejected`) on a
    rejection or when `gates.approval_timeout_s` passes with no allowed answer. A reviewer who
    may not answer is refused in the stage history and the run pauses again for the time left."""
    registry = Registry(config.tracking_uri)
    run_id = str(prefect.runtime.flow_run.id)
    registry.set_revision_tag(revision, APPROVAL_RUN_TAG, run_id)
    approvers = ", ".join(gates.approvers) or "nobody"
    registry.note_stage(
        revision,
        releaser,
        f"awaiting approval by {approvers} for up to {gates.approval_timeout_s} s "
        f"(Prefect flow run {run_id}; answer in the Prefect UI or with `mint approve "
        f"{revision.adapter} --revision {revision.number}`)",
    )
    form = Decision.with_initial_data(
        description=(
            f"Approve **{revision}** as `{revision.adapter}@production`? Started by "
            f"{releaser}; approvers: {approvers}. The flow run's artifacts hold its evaluation."
        ),
        decision=Verdict.APPROVE,
    )
    deadline = time.monotonic() + gates.approval_timeout_s
    while True:
        left = max(1, round(deadline - time.monotonic()))
        try:
            answer = pause_flow_run(wait_for_input=form, timeout=left, poll_interval=POLL_S)
        except FlowPauseTimeout:
            reason = f"rejected: no allowed answer within {gates.approval_timeout_s} s"
            registry.reject(revision, "mint", reason)
            raise RejectedError(f"{revision} {reason}; production did not move") from None
        refused = gates.may_approve(answer.reviewer, releaser)
        if refused is not None:
            registry.note_stage(
                revision, answer.reviewer, f"refused {answer.decision}: {refused}; still waiting"
            )
            continue
        if answer.decision is Verdict.APPROVE:
            registry.note_stage(
                revision, answer.reviewer, f"approved: {answer.comment}", approver=answer.reviewer
            )
            return answer.reviewer
        reason = f"rejected by {answer.reviewer}: {answer.comment}"
        registry.reject(revision, answer.reviewer, reason)
        raise RejectedError(f"{revision} {reason}; production did not move")


def answer_approval(
    config: MintConfig, revision: RevisionId, verdict: Verdict, reviewer: str, comment: str
) -> str:
    """Answer the paused roll-out of `revision` as `reviewer` (what `mint approve` and the
    `approve` deployment do); the flow run's id. Refuses at once, leaving the run paused, a
    reviewer the adapter's gates do not allow."""
    registry = Registry(config.tracking_uri)
    registered = registry.get(revision)
    run_id = registered.tags.get(APPROVAL_RUN_TAG)
    if run_id is None:
        raise NotFoundError(
            f"no roll-out of {revision} has asked for approval; `mint history` and the Prefect "
            "UI show what happened to it"
        )
    releaser = _releaser(registry, revision)
    refused = registry.gates(revision.adapter).may_approve(reviewer, releaser)
    if refused is not None:
        raise ConfigurationError(f"cannot answer the roll-out of {revision}: {refused}")
    decision = Decision(decision=verdict, reviewer=reviewer, comment=comment)
    try:
        resume_flow_run(UUID(run_id), run_input=decision.model_dump(mode="json"))
    except (NotPausedError, FlowPauseTimeout) as e:
        raise ConfigurationError(
            f"the roll-out of {revision} (Prefect flow run {run_id}) is not waiting for an "
            f"answer any more ({e}); it is {registered.stage}"
        ) from e
    return run_id


def _releaser(registry: Registry, revision: RevisionId) -> str:
    """Who started the roll-out now waiting: the author of its 'awaiting approval' note."""
    for move in reversed(registry.stage_history(revision)):
        if move["reason"].startswith("awaiting approval"):
            return move["actor"]
    return ""


@flow(name="approve")
def approve(
    adapter: str, revision: int, reviewer: str, reject: bool = False, comment: str = ""
) -> str:
    """Approve (or, with `reject`, reject) the paused roll-out of `adapter:r<revision>` as
    `reviewer`: the same answer as the form on the paused run, for a reviewer who starts it
    from the deployment or `mint approve`."""
    config = MintConfig.from_env()
    verdict = Verdict.REJECT if reject else Verdict.APPROVE
    run_id = answer_approval(
        config, RevisionId(check_adapter_name(adapter), revision), verdict, reviewer, comment
    )
    return f"{verdict} sent to flow run {run_id}"
