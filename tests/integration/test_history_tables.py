"""Readable histories in MLflow: each model version's description holds a table of what happened
to it, and the registered model's the adapter's alias history, within the 5000 characters
MLflow's schema gives a description (enforced on PostgreSQL)."""

import re
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from flows.approval import Verdict, answer_approval
from flows.promote import promote, rollback
from mint_core.artifacts.digests import sha256_json
from mint_core.config import MintConfig
from mint_core.gates import Gates
from mint_core.history import (
    ADAPTER_HEADER,
    ADAPTER_ROWS,
    DESCRIPTION_CHARS,
    VERSION_HEADER,
    adapter_description,
    version_description,
)
from mint_core.model.base import BaseModel
from mint_core.registry import AliasMove, Registry
from mint_core.revisions import PRODUCTION, RevisionId
from mint_core.states import Stage
from processes import ManagedProcess
from tests.helpers import make_policy
from tests.integration.helpers import move_alias, paused_run, register_random_adapter, toy_release

REGISTERED_BY = make_policy().created_by
"""Who `make_policy`'s revisions are registered by: the first row of their histories."""
SECOND = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


def table(description: str, header: str) -> list[list[str]]:
    """The rows of the markdown table under `header` in `description`, cell by cell."""
    lines = description.split(header + "\n", 1)[1].splitlines()
    return [re.split(r"(?<!\\) \| ", line[2:-2]) for line in lines[1:] if line.startswith("| ")]


def move(
    number: int, to: int, before: int | None, reason: str = "", approver: str = ""
) -> AliasMove:
    at = f"2026-12-01T10:{number // 60:02d}:{number % 60:02d}.123456+00:00"
    return AliasMove(number, at, PRODUCTION, before, to, "carol", reason, approver)


def test_a_version_table_lists_stages_notes_approvals_and_moves_in_time_order() -> None:
    history = [
        {"at": "2026-12-01T10:00:00.5+00:00", "from": "registered", "to": "admitted",
         "actor": "carol", "reason": "release"},
        {"at": "2026-12-01T10:00:03+00:00", "from": "ready", "to": "ready", "actor": "alice",
         "reason": "approved: fine | ship it", "approver": "alice"},
        {"at": "2026-12-01T10:00:05+00:00", "from": "ready", "to": "active", "actor": "carol",
         "reason": "release"},
    ]  # fmt: skip
    text = version_description(
        "trained on train.jsonl", history, [move(4, 2, 1, "release", "alice")]
    )
    assert text.startswith("trained on train.jsonl\n\n")
    assert table(text, VERSION_HEADER) == [
        ["2026-12-01T10:00:00Z", "registered → admitted", "carol", "release", ""],
        ["2026-12-01T10:00:03Z", "approved", "alice", "approved: fine \\| ship it", "alice"],
        ["2026-12-01T10:00:04Z", "production r1 → r2", "carol", "release", "alice"],
        ["2026-12-01T10:00:05Z", "ready → active", "carol", "release", ""],
    ]
    # Written again from the same records, it is the same: the table replaces itself.
    assert version_description(text, history, [move(4, 2, 1, "release", "alice")]) == text


def test_an_adapter_table_lists_every_alias_move() -> None:
    moves = [move(1, 1, None, "release"), move(2, 2, 1, "promote", "alice"), move(3, 1, 2, "oops")]
    text = adapter_description("MinT adapter over base tiny", moves)
    assert text.startswith("MinT adapter over base tiny\n\n")
    assert table(text, ADAPTER_HEADER) == [
        ["2026-12-01T10:00:01Z", PRODUCTION, "", "r1", "carol", "", "release"],
        ["2026-12-01T10:00:02Z", PRODUCTION, "r1", "r2", "carol", "alice", "promote"],
        ["2026-12-01T10:00:03Z", PRODUCTION, "r2", "r1", "carol", "", "oops"],
    ]


def test_a_long_history_keeps_its_newest_rows_within_mlflows_column() -> None:
    moves = [move(n, n % 3 + 1, (n - 1) % 3 + 1, f"reason {n} " + "x" * 1000) for n in range(500)]
    text = adapter_description("MinT adapter over base tiny", moves)
    assert len(text) <= DESCRIPTION_CHARS
    rows = table(text, ADAPTER_HEADER)
    assert 5 < len(rows) < 500
    few = [move(n, n % 3 + 1, (n - 1) % 3 + 1, f"short {n}") for n in range(500)]
    assert [row[6] for row in table(adapter_description("", few), ADAPTER_HEADER)] == [
        f"short {n}" for n in range(500 - ADAPTER_ROWS, 500)
    ]
    assert rows[-1][6].startswith("reason 499 ")  # the newest move is there, its reason cut
    assert [row[6].split()[1] for row in rows] == [str(n) for n in range(500 - len(rows), 500)]
    assert f"_{500 - len(rows)} older moves are only in the versions'" in text


# Against the real MLflow server.


def register(registry: Registry, adapter: str, count: int) -> list[RevisionId]:
    revisions = []
    for number in range(1, count + 1):
        policy = make_policy(adapter=adapter, content_digest=sha256_json([adapter, number]))
        uri = "mint-local://sha256/" + policy.content_digest.removeprefix("sha256:")
        revisions.append(registry.revisions.register(policy, uri, policy.base_digest).id)
    return revisions


@pytest.mark.slow
def test_a_busy_adapter_keeps_registering_on_postgresql(
    postgres_mlflow: ManagedProcess, prefect_api: str
) -> None:
    """PostgreSQL refuses a description over 5000 characters: the tables stay within it however
    long the history grows, and the adapter keeps working."""
    registry = Registry(postgres_mlflow.url)
    adapter = f"long-lived-{uuid.uuid4().hex[:8]}"
    r1, r2 = register(registry, adapter, 2)
    reason = "y" * 2000  # cut to 1000 in the tags, to 300 in the tables
    for step in range(40):
        move_alias(registry, (r1, r2)[step % 2], PRODUCTION, f"actor-{step}", reason, "alice")
        registry.stages.note(r1, f"actor-{step}", reason)
    r3 = register(registry, adapter, 3)[-1]  # a new revision still registers

    client = MlflowClient(postgres_mlflow.url)
    model = client.get_registered_model(adapter).description
    assert len(model) <= DESCRIPTION_CHARS
    rows = table(model, ADAPTER_HEADER)
    assert rows[-1][:6] == [rows[-1][0], PRODUCTION, "r1", "r2", "actor-39", "alice"]
    assert "older moves are only in" in model
    first = client.get_model_version(adapter, str(r1.number)).description
    assert len(first) <= DESCRIPTION_CHARS
    assert table(first, VERSION_HEADER)[-1][1:3] == ["note", "actor-39"]
    assert "older rows are only in the tags" in first
    third = client.get_model_version(adapter, str(r3.number)).description
    assert [row[1] for row in table(third, VERSION_HEADER)] == ["registered"]


@pytest.mark.slow
def test_the_registry_writes_both_tables_as_it_records(
    mlflow_server: ManagedProcess, prefect_api: str
) -> None:
    """The registry's own calls, as a release, an approved promote and a rollback make them."""
    registry = Registry(mlflow_server.url)
    adapter = f"recorded-{uuid.uuid4().hex[:8]}"
    r1, r2 = register(registry, adapter, 2)
    registry.stages.set(r1, Stage.ADMITTED, "carol", "release")
    move_alias(registry, r1, PRODUCTION, "carol", "release")
    registry.stages.note(r2, "alice", "approved: looks right", approver="alice")
    move_alias(registry, r2, PRODUCTION, "carol", "new data", approver="alice")
    move_alias(registry, r1, PRODUCTION, "bob", "answers wrong")

    client = MlflowClient(mlflow_server.url)
    model = client.get_registered_model(adapter).description
    assert [row[1:] for row in table(model, ADAPTER_HEADER)] == [
        [PRODUCTION, "", "r1", "carol", "", "release"],
        [PRODUCTION, "r1", "r2", "carol", "alice", "new data"],
        [PRODUCTION, "r2", "r1", "bob", "", "answers wrong"],
    ]
    second = client.get_model_version(adapter, "2").description
    assert second.startswith("trained on ")
    # Registered by hand (no pipeline steps before it): its history starts at registered.
    assert [row[1:] for row in table(second, VERSION_HEADER)] == [
        ["registered", REGISTERED_BY, "", ""],
        ["approved", "alice", "approved: looks right", "alice"],
        ["production r1 → r2", "carol", "new data", "alice"],
    ]
    first = table(client.get_model_version(adapter, "1").description, VERSION_HEADER)
    assert all(SECOND.match(row[0]) for row in first)
    assert [row[1:] for row in first] == [
        ["registered", REGISTERED_BY, "", ""],
        ["registered → admitted", "carol", "release", ""],
        ["production → r1", "carol", "release", ""],
        ["production r2 → r1", "bob", "answers wrong", ""],
    ]


@pytest.fixture
def background() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield pool


@pytest.mark.slow
def test_a_release_an_approved_promote_and_a_rollback_read_as_tables(
    fleet_config: MintConfig, base: BaseModel, tmp_path: Path, background: ThreadPoolExecutor
) -> None:

    adapter = f"audited-{uuid.uuid4().hex[:6]}"
    registry = Registry(fleet_config.tracking_uri)
    released = toy_release(adapter, "upper", steps=5, actor="carol")  # r1, ungated
    # (Issue 23, item 5: the CLI's figure says which rows it is on.)
    assert released.eval_rows == "64 rows of upper-held-out-n64.jsonl"
    # Any score passes: this test is about what the approval records, not the evaluation.
    gates = Gates(requires_approval=True, approvers=("alice",), max_regression=1.0)
    registry.gates.set(adapter, gates)
    r2 = register_random_adapter(fleet_config, base, adapter, tmp_path / "r2", seed=2)
    promoting = background.submit(promote, adapter, r2.number, actor="carol", reason="new data")
    paused_run(registry, r2)
    answer_approval(fleet_config, r2, Verdict.APPROVE, "alice", "looks right")
    assert promoting.result(timeout=180) == str(r2)
    rollback(adapter, actor="bob", reason="answers wrong")

    client = MlflowClient(fleet_config.tracking_uri)
    model = client.get_registered_model(adapter).description
    assert model.startswith("MinT adapter over base ")
    moves = table(model, ADAPTER_HEADER)
    assert all(SECOND.match(row[0]) for row in moves)
    assert [row[1:] for row in moves] == [
        [PRODUCTION, "", "r1", "carol", "", "release"],
        [PRODUCTION, "r1", "r2", "carol", "alice", "new data"],
        [PRODUCTION, "r2", "r1", "bob", "", "answers wrong"],
    ]
    second = table(client.get_model_version(adapter, str(r2.number)).description, VERSION_HEADER)
    assert all(SECOND.match(row[0]) for row in second)
    events = [row[1:] for row in second]
    assert ["approved", "alice", "approved: looks right", "alice"] in events
    assert ["production r1 → r2", "carol", "new data", "alice"] in events
    assert events[-1] == ["active → retired", "bob", "answers wrong", ""]
    assert events.index(["ready → active", "carol", "new data", ""]) > events.index(
        ["production r1 → r2", "carol", "new data", "alice"]
    )
    first = table(client.get_model_version(adapter, "1").description, VERSION_HEADER)
    assert [row[1:] for row in first if row[1].startswith(PRODUCTION)] == [
        ["production → r1", "carol", "release", ""],
        ["production r2 → r1", "bob", "answers wrong", ""],
    ]
