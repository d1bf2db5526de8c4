"""Approval: a roll-out of an adapter whose gates require it pauses before `activate` until an
allowed reviewer answers, in the Prefect UI (the paused run shows a form) or with
`mint approve`. Every answer, refused ones included, goes into the revision's stage history in
MLflow with its author and comment; no answer before the timeout is a rejection.
"""

import re
import time
from enum import StrEnum
from uuid import UUID

import prefect.runtime
from prefect import flow
from prefect.exceptions import FlowPauseTimeout, NotPausedError
from prefect.flow_runs import pause_flow_run, resume_flow_run
from prefect.input import RunInput
from pydantic import Field

from flows.ending import ends_on_mint_error
from mint_core.config import MintConfig
from mint_core.errors import ConfigurationError, NotFoundError, RejectedError
from mint_core.gates import Gates
from mint_core.planning.evaluation import Evaluation
from mint_core.registry import APPROVAL_RUN_TAG, RegisteredRevision, Registry
from mint_core.revisions import PRODUCTION, RevisionId, RevisionRef, check_adapter_name
from tasks.runs import label_run, run_log, summarize

POLL_S = 2
"""How often a paused run looks for its answer (Prefect's default, 10 s, slows every
approval by that much)."""


class Verdict(StrEnum):
    APPROVE = "approve"
    REJECT = "reject"


class Decision(RunInput):
    """The form the Prefect UI shows on a paused roll-out."""

    decision: Verdict = Field(
        description="approve: it becomes production; reject: it never does. No default: choose one."
    )
    reviewer: str = Field(
        description="Your name, as the adapter's gates list its approvers (the releaser may "
        "not approve their own roll-out unless the gates allow it)."
    )
    """Who answers. Prefect's open-source server does not authenticate its UI's users: the
    reviewer names themself, and the gates decide whether that name may answer."""
    comment: str = Field(default="", description="Why; kept in the revision's stage history.")


def await_approval(
    config: MintConfig,
    revision: RevisionId,
    gates: Gates,
    releaser: str,
    evaluation: Evaluation | None = None,
) -> str:
    """Pause this flow run until an approver of `revision`'s adapter answers. Returns, once
    approved, who approved (recorded on the alias move); RejectedError (stage `rejected`) on a
    rejection or when `gates.approval_timeout_s` passes with no allowed answer. A reviewer who
    may not answer is refused in the stage history and the run's log, and the run pauses again
    for the time left, its form saying whose answer was refused and why. The form shows
    `evaluation` (the gate's scores of `revision` and production) and the threshold it was held
    to."""
    registry = Registry(config.tracking_uri)
    log = run_log()
    run_id = str(prefect.runtime.flow_run.id)
    registry.revisions.set_tag(revision, APPROVAL_RUN_TAG, run_id)
    approvers = ", ".join(gates.approvers) or "nobody"
    registry.stages.note(
        revision,
        releaser,
        f"awaiting approval by {approvers} for up to {gates.approval_timeout_s} s "
        f"(Prefect flow run {run_id}; answer in the Prefect UI or with `mint approve "
        f"{revision.adapter} --revision {revision.number}`)",
    )
    log.info("%s waits for approval by %s", revision, approvers)
    question = _question(registry, revision, gates, releaser, evaluation)
    # No initial data: the decision has no default, so a reviewer who only fills in a name and
    # presses Submit has approved nothing.
    form = Decision.with_initial_data(description=question)
    deadline = time.monotonic() + gates.approval_timeout_s
    while True:
        left = max(1, round(deadline - time.monotonic()))
        try:
            answer = pause_flow_run(wait_for_input=form, timeout=left, poll_interval=POLL_S)
        except FlowPauseTimeout:
            reason = f"rejected: no allowed answer within {gates.approval_timeout_s} s"
            registry.aliases.reject(revision, "mint", reason)
            log.warning("%s %s", revision, reason)
            raise RejectedError(f"{revision} {reason}; production did not move") from None
        refused = gates.may_approve(answer.reviewer, releaser)
        if refused is not None:
            _record_refusal(registry, revision, answer, refused)
            log.warning(
                "refused the answer of %r (%s%s): %s; waiting for an allowed approver",
                answer.reviewer,
                answer.decision,
                _comment(answer),
                refused,
            )
            form = Decision.with_initial_data(
                description=f"{refused_notice(answer, refused)}\n\n{question}"
            )
            continue
        if answer.decision is Verdict.APPROVE:
            registry.stages.note(
                revision, answer.reviewer, f"approved: {answer.comment}", approver=answer.reviewer
            )
            log.info("%s approved by %s: %s", revision, answer.reviewer, answer.comment)
            return answer.reviewer
        reason = f"rejected by {answer.reviewer}: {answer.comment}"
        registry.aliases.reject(revision, answer.reviewer, reason)
        log.warning("%s %s", revision, reason)
        raise RejectedError(f"{revision} {reason}; production did not move")


def _question(
    registry: Registry,
    revision: RevisionId,
    gates: Gates,
    releaser: str,
    evaluation: Evaluation | None,
) -> str:
    """The form's description: what is asked, the candidate's figures beside production's, and
    the threshold the evaluation gate held them to. The table keeps to short labels (which
    revision production serves is above it, what each row means and how many rows each set has
    below it): the Resume form gives a table about 330 px whatever the window, and a wider
    table hides its figure columns behind a scroll."""
    try:
        production: RegisteredRevision | None = registry.revisions.resolve(
            RevisionRef(revision.adapter)
        )
    except NotFoundError:
        production = None
    candidate = registry.revisions.get(revision)
    approvers = ", ".join(gates.approvers) or "nobody"
    serving = f"r{production.id.number}" if production else "nothing yet"
    lines = [
        f"Approve **{revision}** as `{revision.adapter}@{PRODUCTION}` (now {serving})? Started "
        f"by {releaser}; approvers: {approvers}. Choose a decision and name yourself as the "
        "reviewer.",
        "",
        f"| exact match | candidate r{revision.number} | production |",
        "|---|---:|---:|",
    ]
    notes = []
    if evaluation is not None:
        lines += [
            f"| gate: {s.name} | {s.candidate:.2f} | {s.production:.2f} |"
            if s.rows
            else f"| gate: {s.name} | - | - |"
            for s in evaluation.scores
        ]
        sets = "; ".join(f"{s.name}: {s.rows} rows" for s in evaluation.scores)
        notes.append(f"- **gate**: the evaluation gate scored both on the same rows ({sets}).")
    else:
        lines.append("| gate | - | - |")
        notes.append("- **gate**: the evaluation gate had no rows to score both on.")
    lines.append(f"| at training | {_held_out(candidate)} | {_held_out(production)} |")
    notes.append(
        "- **at training**: each on its own held-out rows when it was trained (not the same "
        "rows for both)."
    )
    passed = evaluation is None or evaluation.passed
    verdict = "" if evaluation is None else f"; this candidate {'passed' if passed else 'failed'}"
    lines += [
        "",
        *notes,
        "",
        f"Gate threshold: the candidate may fall at most {gates.max_regression} below "
        f"production's exact match on each set (max_regression){verdict}.",
    ]
    return "\n".join(lines)


def _held_out(registered: RegisteredRevision | None) -> str:
    figure = registered.policy.eval_metrics.get("eval_exact_match") if registered else None
    return "-" if figure is None else f"{figure:.2f}"


def answer_approval(
    config: MintConfig, revision: RevisionId, verdict: Verdict, reviewer: str, comment: str
) -> str:
    """Answer the paused roll-out of `revision` as `reviewer` (what `mint approve` and the
    `approve` deployment do); the flow run's id. Refuses at once, leaving the run paused, a
    reviewer the adapter's gates do not allow."""
    registry = Registry(config.tracking_uri)
    registered = registry.revisions.get(revision)
    run_id = registered.tags.get(APPROVAL_RUN_TAG)
    if run_id is None:
        raise NotFoundError(
            f"no roll-out of {revision} has asked for approval; `mint history` and the Prefect "
            "UI show what happened to it"
        )
    releaser = _releaser(registry, revision)
    decision = Decision(decision=verdict, reviewer=reviewer, comment=comment)
    refused = registry.gates.of(revision.adapter).may_approve(reviewer, releaser)
    if refused is not None:
        # Recorded like a refusal in the Prefect UI: an audit sees every answer.
        _record_refusal(registry, revision, decision, refused)
        raise ConfigurationError(f"cannot answer the roll-out of {revision}: {refused}")
    try:
        resume_flow_run(UUID(run_id), run_input=decision.model_dump(mode="json"))
    except (NotPausedError, FlowPauseTimeout) as e:
        raise ConfigurationError(
            f"the roll-out of {revision} (Prefect flow run {run_id}) is not waiting for an "
            f"answer any more ({e}); it is {registered.stage}"
        ) from e
    return run_id


def _record_refusal(
    registry: Registry, revision: RevisionId, answer: Decision, refused: str
) -> None:
    """Keep a refused answer in `revision`'s stage history, as its author gave it (decision and
    comment) with why it was not taken: the roll-out goes on waiting."""
    registry.stages.note(
        revision,
        answer.reviewer,
        f"refused {answer.decision}: {refused}; still waiting{_comment(answer)}",
    )


def refused_notice(answer: Decision, refused: str) -> str:
    """What the form shown again after a refused answer says first: whose answer it was, as
    they gave it (decision and comment, so the next reviewer reads the reason too), and why it
    was not taken. The comment is shown as typed: on one line, its markdown escaped."""
    comment = f"; comment: {_markdown_text(answer.comment)}" if answer.comment.strip() else ""
    return (
        f"**Refused**: the answer of {answer.reviewer!r} ({answer.decision}{comment}) was not "
        f"taken: {refused}. Waiting for an allowed approver."
    )


def _markdown_text(text: str) -> str:
    """`text` on one line, each character that markdown would read as markup escaped."""
    return re.sub(r"([\\`*_\[\]<>|~])", r"\\\1", " ".join(text.split()))


def _comment(answer: Decision) -> str:
    """ "; comment: ..." when the answer has one (how a refusal's record and log line end)."""
    return f"; comment: {answer.comment}" if answer.comment else ""


def _releaser(registry: Registry, revision: RevisionId) -> str:
    """Who started the roll-out now waiting: the author of its 'awaiting approval' note."""
    for move in reversed(registry.stages.history(revision)):
        if move["reason"].startswith("awaiting approval"):
            return move["actor"]
    return ""


@flow(name="approve", flow_run_name="approve {adapter} r{revision} as {reviewer}")
@ends_on_mint_error
def approve(
    adapter: str, revision: int, reviewer: str, reject: bool = False, comment: str = ""
) -> str:
    """Approve (or, with `reject`, reject) the paused roll-out of `adapter:r<revision>` as
    `reviewer`: the same answer as the form on the paused run, for a reviewer who starts it
    from the deployment or `mint approve`.

    Args:
        adapter: The adapter whose roll-out waits for approval, e.g. `support-bot`.
        revision: The number N of the revision `adapter:rN` waiting to become production.
        reviewer: Your name, as the adapter's gates list its approvers; a name they do not
            allow is refused, and the refusal is recorded.
        reject: Reject the revision instead of approving it.
        comment: Why; kept in the revision's stage history.
    """
    config = MintConfig.from_env()
    label_run(check_adapter_name(adapter))
    verdict = Verdict.REJECT if reject else Verdict.APPROVE
    run_id = answer_approval(config, RevisionId(adapter, revision), verdict, reviewer, comment)
    summarize(
        adapter,
        f"{verdict} of {adapter}:r{revision} by {reviewer}",
        {"sent to": f"flow run {run_id}", "comment": comment or "-"},
    )
    return f"{verdict} sent to flow run {run_id}"
