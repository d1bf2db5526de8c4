"""The pure roster (`mint_core.planning.roster`): which announced workers a reader counts as
members, step by step, on the reader's own clock."""

from dataclasses import dataclass

import pytest

from mint_core.membership import FleetSource, FleetWatch
from mint_core.planning import roster
from mint_core.planning.roster import Beat, Member, Sightings, Standing

WATCH = FleetWatch(FleetSource.REGISTRY, heartbeat_s=2.0, stale_s=8.0, forget_s=60.0)
A, B = "http://a:8000", "http://b:8000"
FAILED = None
"""A read that failed."""


@dataclass(frozen=True)
class Step:
    at: float
    """The reader's clock at the read."""
    read: dict[str, int] | None
    """What the read found (URL -> seq of every RUNNING record), or FAILED."""
    fleet: tuple[str, ...]
    """The fleet after it."""


CASES = {
    "a first sighting counts as a beat": [Step(0, {A: 5}, (A,))],
    "beating keeps a member": [
        Step(0, {A: 1}, (A,)),
        Step(6, {A: 4}, (A,)),
        Step(12, {A: 7}, (A,)),
        Step(19, {A: 10}, (A,)),
    ],
    "silent for stale_s is left out": [
        Step(0, {A: 1, B: 1}, (A, B)),
        Step(7.9, {A: 1, B: 4}, (A, B)),
        Step(8, {A: 1, B: 5}, (B,)),
    ],
    "a stale member beating again is back at once": [
        Step(0, {A: 1}, (A,)),
        Step(10, {A: 1}, ()),
        Step(11, {A: 2}, (A,)),
    ],
    "a finished (absent) member is gone at once": [
        Step(0, {A: 1, B: 1}, (A, B)),
        Step(1, {B: 2}, (B,)),
    ],
    "a forgotten member stays forgotten while its record is unchanged": [
        Step(0, {A: 1, B: 1}, (A, B)),
        Step(30, {A: 1, B: 15}, (B,)),
        Step(60, {A: 1, B: 30}, (B,)),
        Step(61, {A: 1, B: 31}, (B,)),
        Step(62, {A: 2, B: 32}, (A, B)),
    ],
    "a failed read freezes the fleet": [
        Step(0, {A: 1, B: 1}, (A, B)),
        Step(5, FAILED, (A, B)),
        Step(100, FAILED, (A, B)),
    ],
    "the time up to and after a failed read ages nobody": [
        Step(0, {A: 1, B: 1}, (A, B)),
        Step(7, FAILED, (A, B)),
        Step(300, {A: 1, B: 1}, (A, B)),  # back: no watching counted since 0
        Step(307.9, {A: 1, B: 2}, (A, B)),
        Step(308, {A: 1, B: 3}, (B,)),  # 8 s of watching since A's last change
    ],
    "a joiner during an outage counts from the first good read": [
        Step(0, {A: 1}, (A,)),
        Step(1, FAILED, (A,)),
        Step(50, {A: 2, B: 1}, (A, B)),
        Step(57, {A: 5, B: 1}, (A, B)),
        Step(58, {A: 6, B: 1}, (A,)),
    ],
}


def _beats(read: dict[str, int]) -> list[Beat]:
    return [Beat(Member(url, "host", "tiny", "sha256:x"), seq) for url, seq in read.items()]


@pytest.mark.parametrize("steps", CASES.values(), ids=CASES.keys())
def test_roster(steps: list[Step]) -> None:
    state = Sightings()
    for number, step in enumerate(steps):
        if step.read is FAILED:
            state = roster.missed(state)
        else:
            state = roster.seen(state, _beats(step.read), step.at, WATCH)
        assert roster.fleet(state, WATCH) == step.fleet, f"after step {number} ({step})"


def test_standings_and_members() -> None:
    state = roster.seen(Sightings(), _beats({A: 1, B: 1}), 0, WATCH)
    state = roster.seen(state, _beats({A: 1, B: 2}), 9, WATCH)
    assert roster.standing(state, A, WATCH) is Standing.STALE
    assert roster.standing(state, B, WATCH) is Standing.LIVE
    assert roster.standing(state, "http://c:8000", WATCH) is Standing.FORGOTTEN
    assert roster.members(state, WATCH) == (Member(B, "host", "tiny", "sha256:x"),)
    state = roster.seen(state, _beats({A: 1, B: 3}), 61, WATCH)
    assert roster.standing(state, A, WATCH) is Standing.FORGOTTEN
    assert state.forgotten == {A: 1}


def test_a_member_that_moves_is_read_with_its_new_tags() -> None:
    state = roster.seen(Sightings(), _beats({A: 1}), 0, WATCH)
    moved = [Beat(Member(A, "other-host", "tiny", "sha256:y"), 1)]
    state = roster.seen(state, moved, 1, WATCH)
    assert roster.members(state, WATCH) == (moved[0].member,)


def test_a_member_that_says_it_is_leaving_is_out_at_once_until_it_serves_again() -> None:
    member = Member(A, "host", "tiny", "sha256:x")
    state = roster.seen(Sightings(), _beats({A: 1, B: 1}), 0, WATCH)
    state = roster.seen(state, [Beat(member, 1, leaving=True), *_beats({B: 1})], 1, WATCH)
    assert roster.standing(state, A, WATCH) is Standing.LEAVING
    assert roster.fleet(state, WATCH) == (B,)
    state = roster.seen(state, [Beat(member, 2, leaving=True), *_beats({B: 2})], 2, WATCH)
    assert roster.fleet(state, WATCH) == (B,)  # beating on while it finishes: still out
    state = roster.seen(state, _beats({A: 3, B: 3}), 3, WATCH)  # started again
    assert roster.standing(state, A, WATCH) is Standing.LIVE
    assert roster.fleet(state, WATCH) == (A, B)
