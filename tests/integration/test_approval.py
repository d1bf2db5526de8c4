"""Approval through a real Prefect server: a roll-out of an adapter whose gates require approval
pauses before `activate` with a form; only an allowed reviewer's answer resumes it for good, and
every answer lands in the revision's stage history in MLflow."""

import json
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from uuid import UUID

import pytest
from prefect import get_client
from prefect.flow_runs import resume_flow_run

from flows.approval import Verdict, answer_approval
from flows.promote import promote
from mint_core.artifacts.digests import sha256_json
from mint_core.config import MintConfig
from mint_core.errors import ConfigurationError, RejectedError
from mint_core.gates import Gates
from mint_core.model.base import BaseModel
from mint_core.model.toy import Task, write_held_out_data
from mint_core.registry import APPROVAL_RUN_TAG, Registry
from mint_core.revisions import PRODUCTION, RevisionId, RevisionRef
from mint_core.states import Stage
from processes import ManagedProcess
from tests.helpers import make_policy
from tests.integration.helpers import paused_run, register_random_adapter, run_logs
from tests.integration.helpers import toy_release as release

pytestmark = pytest.mark.slow

RELEASER = "carol"
GATES = Gates(requires_approval=True, approvers=("alice", RELEASER), approval_timeout_s=60)
"""Short enough that a failed test does not wait long for its paused roll-out to end."""
MALLORY_REFUSED = (
    "refused approve: 'mallory' is not an approver of this adapter; its approvers: alice, carol; "
    "still waiting; comment: looks fine to me"
)
"""How the stage history keeps mallory's refused answer, comment included."""


@pytest.fixture
def background() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield pool


@pytest.fixture
def gated(
    fleet_config: MintConfig, base: BaseModel, tmp_path: Path
) -> Callable[[str], tuple[Registry, RevisionId]]:
    """An adapter with r1 in production (no gates yet), then gates requiring approval and a
    registered r2 waiting to be rolled out."""

    def make(name: str) -> tuple[Registry, RevisionId]:
        registry = Registry(fleet_config.tracking_uri)
        first = register_random_adapter(fleet_config, base, name, tmp_path / "r1", seed=1)
        promote(name, first.number)
        registry.gates.set(name, GATES)
        second = register_random_adapter(fleet_config, base, name, tmp_path / "r2", seed=2)
        return registry, second

    return make


def production(registry: Registry, adapter: str) -> int:
    return registry.revisions.resolve(RevisionRef(adapter)).id.number


def decisions(registry: Registry, revision: RevisionId) -> list[tuple[str, str, str]]:
    return [(m["actor"], m["to"], m["reason"]) for m in registry.stages.history(revision)]


def test_a_release_waits_for_an_allowed_approver(
    gated: Callable[[str], tuple[Registry, RevisionId]],
    background: ThreadPoolExecutor,
    fleet_config: MintConfig,
) -> None:
    registry, registered = gated("approved-bot")
    # A release (training r3) of the gated adapter, started by carol.
    releasing: Future[object] = background.submit(
        release, "approved-bot", "upper", steps=5, actor=RELEASER
    )
    candidate = RevisionId("approved-bot", registered.number + 1)
    run_id = paused_run(registry, candidate)
    assert (
        registry.revisions.get(candidate).stage is Stage.READY
    )  # admitted and prewarmed, not active
    assert production(registry, "approved-bot") == 1

    # Refused before it reaches the run: not an approver, or approving one's own roll-out.
    with pytest.raises(ConfigurationError, match=r"'mallory' is not an approver.*alice, carol"):
        answer_approval(fleet_config, candidate, Verdict.APPROVE, "mallory", "")
    with pytest.raises(ConfigurationError, match="'carol' started this roll-out"):
        answer_approval(fleet_config, candidate, Verdict.APPROVE, RELEASER, "")
    # Through the Prefect API directly (as the UI's form does): the run refuses it and pauses
    # again; production stays.
    resume_flow_run(
        run_id,
        run_input={"decision": "approve", "reviewer": "mallory", "comment": "looks fine to me"},
    )
    assert paused_run(registry, candidate, pauses=2) == run_id
    assert production(registry, "approved-bot") == 1
    assert not releasing.done()

    resume_flow_run(
        run_id, run_input={"decision": "approve", "reviewer": "alice", "comment": "looks right"}
    )
    assert releasing.result(timeout=120).revision == str(candidate)  # type: ignore[attr-defined]
    assert production(registry, "approved-bot") == candidate.number
    history = decisions(registry, candidate)
    # The refused answer is kept with its comment, as the approval is.
    assert ("mallory", "ready", MALLORY_REFUSED) in history
    assert ("alice", "ready", "approved: looks right") in history
    assert history[-1][:2] == (RELEASER, "active")


def test_a_rejection_leaves_production_where_it_was(
    gated: Callable[[str], tuple[Registry, RevisionId]],
    background: ThreadPoolExecutor,
    fleet_config: MintConfig,
) -> None:
    registry, candidate = gated("rejected-bot")
    promoting = background.submit(promote, "rejected-bot", candidate.number, actor=RELEASER)
    paused_run(registry, candidate)
    # What `mint approve rejected-bot --revision 2 --reject --comment ...` does.
    answer_approval(fleet_config, candidate, Verdict.REJECT, "alice", "answers are wrong")
    with pytest.raises(RejectedError, match="rejected by alice: answers are wrong"):
        promoting.result(timeout=120)
    assert production(registry, "rejected-bot") == 1
    assert registry.revisions.get(candidate).stage is Stage.REJECTED
    assert decisions(registry, candidate)[-1] == (
        "alice", "rejected", "rejected by alice: answers are wrong"
    )  # fmt: skip
    # Nobody can answer it any more.
    with pytest.raises(ConfigurationError, match="not waiting for an answer"):
        answer_approval(fleet_config, candidate, Verdict.APPROVE, "alice", "")


def test_no_answer_before_the_timeout_is_a_rejection(
    gated: Callable[[str], tuple[Registry, RevisionId]],
) -> None:
    registry, candidate = gated("timeout-bot")
    registry.gates.set("timeout-bot", GATES.changed(approval_timeout_s=3))
    with pytest.raises(RejectedError, match="no allowed answer within 3 s"):
        promote("timeout-bot", candidate.number, actor=RELEASER)
    assert production(registry, "timeout-bot") == 1
    assert registry.revisions.get(candidate).stage is Stage.REJECTED
    assert PRODUCTION not in registry.revisions.get(candidate).aliases


def paused_form(run_id: UUID) -> tuple[str, dict[str, object]]:
    """The description and the JSON schema of the form the Prefect UI shows on a paused run."""
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(run_id).state
        assert state is not None and state.state_details.run_input_keyset is not None
        keys = state.state_details.run_input_keyset
        description = json.loads(client.read_flow_run_input(run_id, keys["description"]))
        schema = json.loads(client.read_flow_run_input(run_id, keys["schema"]))
    return description, schema


def test_the_form_asks_for_a_decision_shows_the_figures_and_every_refusal_is_kept(
    gated: Callable[[str], tuple[Registry, RevisionId]],
    background: ThreadPoolExecutor,
    fleet_config: MintConfig,
    tmp_path: Path,
) -> None:
    registry, candidate = gated("form-bot")
    rows = write_held_out_data(Task.UPPER, tmp_path, count=4)
    registry.gates.set("form-bot", GATES.changed(eval_data=str(rows), max_regression=1.0))
    promoting = background.submit(promote, "form-bot", candidate.number, actor=RELEASER)
    run_id = paused_run(registry, candidate)

    description, schema = paused_form(run_id)
    # Nothing is preset: a reviewer who only fills in a name approves nothing.
    assert "decision" in schema["required"]  # type: ignore[operator]
    assert "default" not in schema["properties"]["decision"]  # type: ignore[index]
    lines = description.splitlines()
    header = next(line for line in lines if line.startswith("|"))
    assert f"candidate r{candidate.number} | production |" in header
    assert "`form-bot@production` (now r1)" in description
    assert any(line.startswith("| gate: eval | ") for line in lines), description
    assert "scored both on the same rows (eval: 4 rows)" in description
    assert any("threshold" in line and "at most 1.0 below production" in line for line in lines)

    # Refused on the command line (`mint approve`): each refusal is in the stage history, with
    # its comment.
    with pytest.raises(ConfigurationError, match="'mallory' is not an approver"):
        answer_approval(fleet_config, candidate, Verdict.APPROVE, "mallory", "looks fine to me")
    with pytest.raises(ConfigurationError, match="'carol' started this roll-out"):
        answer_approval(fleet_config, candidate, Verdict.REJECT, RELEASER, "")
    history = decisions(registry, candidate)
    assert ("mallory", "ready", MALLORY_REFUSED) in history
    assert any(
        actor == RELEASER and reason.startswith("refused reject: 'carol' started this roll-out")
        for actor, _, reason in history
    ), history

    # Refused in the UI's form: a warning in the run's log, the answer and its comment in the
    # stage history, and the new form says why.
    resume_flow_run(
        run_id, run_input={"decision": "reject", "reviewer": "mallory", "comment": "not sure"}
    )
    paused_run(registry, candidate, pauses=2)
    again, _ = paused_form(run_id)
    # The comment too (issue 48, item 10): the next reviewer reads why mallory answered so.
    assert again.startswith(
        "**Refused**: the answer of 'mallory' (reject; comment: not sure) was not taken: "
        "'mallory' is not an approver of this adapter"
    )
    assert header in again.splitlines()
    warning = ("WARNING refused the answer of 'mallory' (reject; comment: not sure): 'mallory' is "
               "not an approver")  # fmt: skip
    assert any(line.startswith(warning) for line in run_logs(run_id, expect=warning))
    assert ("mallory", "ready", "refused reject: 'mallory' is not an approver of this adapter; "
            "its approvers: alice, carol; still waiting; comment: not sure") in (
        decisions(registry, candidate)
    )  # fmt: skip

    answer_approval(fleet_config, candidate, Verdict.REJECT, "alice", "not now")
    with pytest.raises(RejectedError, match="rejected by alice: not now"):
        promoting.result(timeout=120)


def test_mint_approve_records_each_refused_answer(mlflow_server: ManagedProcess) -> None:
    """`mint approve` refuses a non-approver and the releaser at once, and the revision's stage
    history keeps both refusals (no Prefect run is needed: nothing reaches it)."""
    registry = Registry(mlflow_server.url)
    policy = make_policy(adapter="refused-bot", content_digest=sha256_json(["refused-bot"]))
    uri = "mint-local://sha256/" + policy.content_digest.removeprefix("sha256:")
    revision = registry.revisions.register(policy, uri, policy.base_digest).id
    registry.gates.set("refused-bot", GATES)
    registry.revisions.set_tag(revision, APPROVAL_RUN_TAG, "00000000-0000-0000-0000-000000000000")
    registry.stages.note(revision, RELEASER, "awaiting approval by alice, carol")
    config = MintConfig(tracking_uri=mlflow_server.url)

    with pytest.raises(ConfigurationError, match="'mallory' is not an approver"):
        answer_approval(config, revision, Verdict.APPROVE, "mallory", "looks fine to me")
    with pytest.raises(ConfigurationError, match="'carol' started this roll-out"):
        answer_approval(config, revision, Verdict.REJECT, RELEASER, "")

    # Each answer with its comment (none given: none recorded).
    answers = [(actor, reason) for actor, _, reason in decisions(registry, revision)]
    assert answers[-2:] == [
        ("mallory", MALLORY_REFUSED),
        (RELEASER, "refused reject: 'carol' started this roll-out and this adapter does not "
                   "allow approving one's own roll-out; another approver must answer; still "
                   "waiting"),
    ]  # fmt: skip
    assert registry.revisions.get(revision).stage is Stage.REGISTERED
