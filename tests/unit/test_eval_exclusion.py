"""The evaluation gate never scores a revision on a row it trained on: rows are known by their
content's digest, each trained revision records the digests of its training rows, and the gate
leaves those rows out of every set it scores, counting them and saying why."""

from pathlib import Path

import pytest

from mint_core.artifacts.stores import LocalArtifactStore
from mint_core.errors import NotFoundError
from mint_core.gates import Gates
from mint_core.model.datasets import Row
from mint_core.planning.evaluation import (
    EvalRows,
    EvalSet,
    Evaluation,
    Exclusion,
    Rows,
    SetScore,
    choose_eval_sets,
    load_digests,
    store_digests,
)
from mint_core.revisions import RevisionId

CANDIDATE = RevisionId("support-bot", 2)
PRODUCTION = RevisionId("support-bot", 1)
HELD = tuple(Row(i, prompt=f"{w}=", completion=w.upper()) for i, w in enumerate("abcdef", 1))


def digests(rows: Rows) -> frozenset[str]:
    return frozenset(row.digest() for row in rows)


def test_a_row_is_known_by_its_content_not_its_line() -> None:
    assert Row(99, prompt="a=", completion="A").digest() == HELD[0].digest()
    assert Row(1, prompt="a=", completion="a").digest() != HELD[0].digest()
    chat = ({"role": "user", "content": "a="}, {"role": "assistant", "content": "A"})
    assert Row(1, messages=chat).digest() not in digests(HELD)
    assert HELD[0].digest().startswith("sha256:")


def test_rows_either_revision_trained_on_are_left_out_counted_and_named() -> None:
    trained = {CANDIDATE: digests(HELD[:2]), PRODUCTION: digests(HELD[1:3])}
    chosen = choose_eval_sets(
        Gates(eval_data="data/eval.jsonl"),
        CANDIDATE,
        PRODUCTION,
        {"data/eval.jsonl": HELD}.__getitem__,
        {}.get,
        trained,
        limit=2,
    )
    # The limit counts rows scored: it applies after the rows trained on are left out.
    assert chosen == {
        EvalSet.EVAL: EvalRows(
            HELD[3:5],
            "of eval.jsonl",
            (
                Exclusion(2, "trained on by support-bot:r2"),
                Exclusion(1, "trained on by support-bot:r1"),
            ),
        )
    }


def test_productions_rows_all_trained_on_leave_the_candidates_own_to_score() -> None:
    stored = {PRODUCTION: HELD[:2], CANDIDATE: HELD[2:]}
    trained = {CANDIDATE: digests(HELD[:2]), PRODUCTION: None}
    chosen = choose_eval_sets(
        Gates(), CANDIDATE, PRODUCTION, {}.__getitem__, stored.get, trained, 9
    )
    assert chosen == {
        EvalSet.EVAL: EvalRows(
            HELD[2:],
            "support-bot:r2 was evaluated on in training",
            (Exclusion(2, "trained on by support-bot:r2, all of support-bot:r1's held-out rows"),),
        )
    }


def test_every_row_trained_on_leaves_a_set_with_nothing_to_score_and_says_so() -> None:
    stored = {PRODUCTION: HELD}
    trained = {CANDIDATE: digests(HELD), PRODUCTION: None}
    chosen = choose_eval_sets(
        Gates(), CANDIDATE, PRODUCTION, {}.__getitem__, stored.get, trained, 9
    )
    assert chosen == {
        EvalSet.EVAL: EvalRows(
            (),
            "support-bot:r1 was evaluated on in training",
            (Exclusion(6, "trained on by support-bot:r2"),),
        )
    }


def test_revisions_without_recorded_training_rows_exclude_nothing() -> None:
    chosen = choose_eval_sets(
        Gates(), CANDIDATE, PRODUCTION, {}.__getitem__, {PRODUCTION: HELD}.get, {}, limit=9
    )
    assert chosen == {
        EvalSet.EVAL: EvalRows(HELD, "support-bot:r1 was evaluated on in training", ())
    }


def test_training_row_digests_round_trip_through_the_store(tmp_path: Path) -> None:
    store = LocalArtifactStore(tmp_path / "store")
    staging = tmp_path / "staging"
    name = store_digests(store, staging, digests(HELD))
    assert store_digests(store, staging, reversed(sorted(digests(HELD)))) == name  # by content
    assert load_digests(store, staging, name, CANDIDATE) == digests(HELD)
    assert list(staging.iterdir()) == []
    with pytest.raises(NotFoundError, match=r"training rows of support-bot:r2 .* are gone"):
        load_digests(store, staging, "train-rows/sha256/missing.txt", CANDIDATE)


def test_the_gates_table_tags_and_reason_say_how_many_rows_were_scored_and_left_out() -> None:
    scores = (
        SetScore(
            EvalSet.EVAL,
            40,
            0.5,
            0.75,
            "of eval.jsonl",
            (Exclusion(360, "trained on by a:r2"), Exclusion(3, "trained on by a:r1")),
        ),
        SetScore(EvalSet.REGRESSION, 20, 1.0, 1.0),
    )
    evaluation = Evaluation(RevisionId("a", 2), RevisionId("a", 1), scores, 0.3)
    assert evaluation.reason() == (
        "evaluation passed: a:r2 exact 0.50 vs production a:r1 0.75 on 40 eval rows of "
        "eval.jsonl, 363 left out (360 trained on by a:r2, 3 trained on by a:r1); a:r2 exact "
        "1.00 vs production a:r1 1.00 on 20 regression rows, none left out (max regression 0.3)"
    )
    table = evaluation.table()
    assert [
        (row["set"], row["role"], row["rows_scored"], row["rows_left_out"]) for row in table
    ] == [
        ("eval", "candidate", 40, 363),
        ("eval", "production", 40, 363),
        ("regression", "candidate", 20, 0),
        ("regression", "production", 20, 0),
    ]
    assert table[0]["why_left_out"] == "360 trained on by a:r2, 3 trained on by a:r1"
    assert table[2]["why_left_out"] == ""
    tags = evaluation.tags()
    assert tags["mint.eval.rows_scored"] == "40"
    assert tags["mint.eval.rows_left_out"] == "363 (360 trained on by a:r2, 3 trained on by a:r1)"
    assert tags["mint.eval.regression_rows_left_out"] == "0"


def test_the_reason_says_when_a_revisions_training_rows_could_not_be_checked() -> None:
    scores = (SetScore(EvalSet.EVAL, 4, 1.0, 1.0),)
    evaluation = Evaluation(
        RevisionId("a", 2), RevisionId("a", 1), scores, 0.05, (RevisionId("a", 1),)
    )
    assert evaluation.reason().endswith(
        "(max regression 0.05; a:r1 records no training rows, so rows it trained on could not "
        "be left out)"
    )


def test_a_set_with_every_row_left_out_is_said_to_be_unscored_not_scored_zero() -> None:
    left_out = SetScore(
        EvalSet.EVAL, 0, 0.0, 0.0, "of eval.jsonl", (Exclusion(6, "trained on by a:r2"),)
    )
    evaluation = Evaluation(RevisionId("a", 2), RevisionId("a", 1), (left_out,), 0.05)
    assert evaluation.passed  # nothing to compare, as when no rows are named at all
    assert evaluation.reason() == (
        "evaluation passed: no eval rows left to score: 0 eval rows of eval.jsonl, 6 left out "
        "(6 trained on by a:r2) (max regression 0.05)"
    )
    assert "mint.eval.candidate.exact_match" not in evaluation.tags()
    assert evaluation.tags()["mint.eval.rows_left_out"] == "6 (6 trained on by a:r2)"
