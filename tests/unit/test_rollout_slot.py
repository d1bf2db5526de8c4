"""Issue 33, items 3 and 9, without processes: an alias move's roll-out slot comes only from
its lock and stops counting once the lock is let go; a revision's first stage history walks
the pipeline's steps in order, each at its own time."""

import pytest

from mint_core.errors import SlotNotHeldError, TransitionError
from mint_core.registry import RolloutSlot, StageMark, held_slot
from mint_core.registry.stage_log import UNREGISTERED, first_history
from mint_core.states import Stage


def test_a_slot_is_only_made_by_its_lock_and_counts_only_while_held() -> None:
    with pytest.raises(SlotNotHeldError, match=r"with rollout_lock\('a-bot'\) as slot"):
        RolloutSlot("a-bot", "mint-rollout-a-bot")
    with held_slot("a-bot", "mint-rollout-a-bot") as slot:
        slot.check("a-bot")
        with pytest.raises(SlotNotHeldError, match="'a-bot' cannot move aliases of 'b-bot'"):
            slot.check("b-bot")
    assert not slot.held
    with pytest.raises(SlotNotHeldError, match="was let go before this alias move"):
        slot.check("a-bot")


def test_the_first_history_walks_the_pipeline_in_order() -> None:
    marks = [
        StageMark(stage, f"2026-12-02T10:00:0{n}+00:00") for n, stage in enumerate(UNREGISTERED)
    ]
    history = first_history(marks, "alice")
    assert [(e["from"], e["to"]) for e in history] == [
        ("", "trained"), ("trained", "frozen"), ("frozen", "packed"), ("packed", "exported"),
        ("exported", "registered"),
    ]  # fmt: skip
    assert [e["at"] for e in history[:4]] == [mark.at for mark in marks]
    assert {e["actor"] for e in history} == {"alice"}
    assert [e["to"] for e in first_history([], "bob")] == ["registered"]
    with pytest.raises(TransitionError, match="starts at trained, not frozen"):
        first_history(marks[1:], "alice")
    with pytest.raises(TransitionError, match="cannot move from trained to packed"):
        first_history([marks[0], marks[2]], "alice")
    assert Stage.REGISTERED not in UNREGISTERED
