"""The roll-out's decisions as pure functions, with no registry, worker or Prefect: which rows
the evaluation gate scores, the eval rows' round trip through the store, the re-export checks,
and the records the registry reads back from tags."""

from pathlib import Path

import pytest

from mint_core.artifacts.freezing import FrozenAdapter
from mint_core.artifacts.packing import PackedIndex
from mint_core.artifacts.reexport import check_repacked, frozen_files
from mint_core.artifacts.stores import LocalArtifactStore
from mint_core.errors import IntegrityError, NotFoundError
from mint_core.gates import Gates
from mint_core.model.datasets import Row
from mint_core.planning.evaluation import EvalSet, Rows, choose_eval_sets, load_rows, store_rows
from mint_core.registry import AliasMove, MoveRecord, RegisteredRevision
from mint_core.registry.moves import done_moves, records_in
from mint_core.revisions import PRODUCTION, RevisionId
from mint_core.states import Stage
from tests.helpers import make_policy

CANDIDATE = RevisionId("support-bot", 2)
PRODUCTION_REVISION = RevisionId("support-bot", 1)


def rows(tag: str, count: int) -> Rows:
    return tuple(Row(i + 1, f"{tag}-{i}", tag) for i in range(count))


FILES = {"eval.jsonl": rows("file", 5), "s3://b/old/regress.jsonl": rows("regress", 2)}
STORED = {PRODUCTION_REVISION: rows("production", 4), CANDIDATE: rows("candidate", 4)}


@pytest.mark.parametrize(
    ("gates", "stored", "expected"),
    [
        (
            Gates(eval_data="eval.jsonl", regression_data="s3://b/old/regress.jsonl"),
            STORED,
            {
                EvalSet.EVAL: (FILES["eval.jsonl"][:3], "of eval.jsonl"),
                EvalSet.REGRESSION: (FILES["s3://b/old/regress.jsonl"], "of regress.jsonl"),
            },
        ),
        (
            Gates(),
            STORED,
            {
                EvalSet.EVAL: (
                    STORED[PRODUCTION_REVISION][:3],
                    "support-bot:r1 was evaluated on in training",
                )
            },
        ),
        (
            Gates(),
            {CANDIDATE: STORED[CANDIDATE]},
            {EvalSet.EVAL: (STORED[CANDIDATE][:3], "support-bot:r2 was evaluated on in training")},
        ),
        (
            Gates(regression_data="eval.jsonl"),
            {},
            {EvalSet.REGRESSION: (FILES["eval.jsonl"][:3], "of eval.jsonl")},
        ),
        (Gates(), {}, {}),
    ],
    ids=["files", "production-rows", "candidate-rows", "regression-only", "nothing"],
)
def test_the_gate_scores_the_gates_files_else_productions_rows_else_the_candidates(
    gates: Gates, stored: dict[RevisionId, Rows], expected: dict[EvalSet, tuple[Rows, str]]
) -> None:
    chosen = choose_eval_sets(
        gates, CANDIDATE, PRODUCTION_REVISION, FILES.__getitem__, stored.get, {}, limit=3
    )
    # Which rows are left out as trained on: tests/unit/test_eval_exclusion.py.
    assert {name: (rows.rows, rows.source) for name, rows in chosen.items()} == expected
    assert all(rows.excluded == () for rows in chosen.values())
    assert list(chosen) == [name for name in EvalSet if name in expected]


def test_eval_rows_round_trip_through_the_store_and_leave_no_staging_file(tmp_path: Path) -> None:
    store = LocalArtifactStore(tmp_path / "store")
    staging = tmp_path / "staging"
    chat = ({"role": "user", "content": "b"}, {"role": "assistant", "content": "B"})
    held_out = (Row(1, "a", "A"), Row(2, messages=chat))
    name = store_rows(store, staging, held_out)
    assert store_rows(store, staging, held_out) == name  # named by content
    loaded = load_rows(store, staging, name, CANDIDATE)
    assert [(r.prompt, r.completion, r.messages) for r in loaded] == [
        (r.prompt, r.completion, r.messages) for r in held_out
    ]
    assert list(staging.iterdir()) == []
    with pytest.raises(NotFoundError, match=r"eval rows of support-bot:r2 .* are gone"):
        load_rows(store, staging, "eval-rows/sha256/missing.jsonl", CANDIDATE)


def test_reexport_refuses_without_frozen_files_and_checks_the_content(tmp_path: Path) -> None:
    policy = make_policy()
    with pytest.raises(NotFoundError, match=r"frozen files .* are gone"):
        frozen_files(CANDIDATE, policy, "mint-local://sha256/x", tmp_path)
    frozen = FrozenAdapter(path=tmp_path, digest=policy.frozen_digest or "", files={})
    check_repacked(CANDIDATE, policy, frozen, PackedIndex({}, {}, (), policy.content_digest))
    other = PackedIndex({}, {}, (), "sha256:" + "0" * 64)
    with pytest.raises(IntegrityError, match="not what was registered"):
        check_repacked(CANDIDATE, policy, frozen, other)


def test_a_revision_record_reads_its_stage_policy_and_done_moves_from_tags() -> None:
    policy = make_policy()
    done = MoveRecord(AliasMove(2, "t", PRODUCTION, 1, 2, "alice", "release"), done=True)
    intent = MoveRecord(AliasMove(3, "t", PRODUCTION, 2, 2, "bob", "again"), done=False)
    tags = {**policy.to_tags(), done.move.tag: done.to_tag(), intent.move.tag: intent.to_tag()}
    registered = RegisteredRevision.from_tags(CANDIDATE, "mint-local://sha256/x", tags)
    assert (registered.stage, registered.policy, registered.aliases) == (
        Stage.REGISTERED,
        policy,
        (),
    )
    assert done_moves(records_in(registered.tags)) == [done.move]
    kept_apart = RegisteredRevision.from_tags(
        CANDIDATE, "u", {"mint.stage": "ready"}, (PRODUCTION,), policy=policy
    )
    assert (kept_apart.stage, kept_apart.policy, kept_apart.aliases) == (
        Stage.READY,
        policy,
        (PRODUCTION,),
    )
