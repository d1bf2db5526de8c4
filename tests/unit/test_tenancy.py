"""Teams sharing a fleet (mint_core.tenancy): the fair order in which waiting requests join a
batch, as an exact table of who gets the next slot; quotas as token buckets on a clock the test
moves (who is let in, which limit refuses, Retry-After, a quota held over two minutes); the
tenancy file's terms, refused naming the bad value, read again when it changes."""

import json
import os
from pathlib import Path

import pytest

from mint_core.errors import ConfigurationError, RateLimitedError
from mint_core.tenancy import (
    BURST_S,
    RELOAD_S,
    FairQueue,
    Limiter,
    Quota,
    Tenancy,
    TenancyFile,
    Terms,
    batch_shares,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def served(queue: FairQueue[str], slots: int) -> list[str]:
    """The next `slots` to join, one at a time (each join moves the virtual time)."""
    order = []
    for _ in range(slots):
        first = queue.ordered()[0]
        queue.take(first)
        order.append(first)
    return order


def test_a_flooding_principal_lengthens_only_its_own_line() -> None:
    queue: FairQueue[str] = FairQueue()
    for name in ("a1", "a2", "a3", "a4"):
        queue.push(name, "loud", cost=10)
    queue.push("b1", "quiet", cost=10)
    queue.push("b2", "quiet", cost=10)
    # Start tags: a1 0, a2 10, a3 20, a4 30; b1 0, b2 10 (ties: arrival order).
    assert queue.ordered() == ["a1", "b1", "a2", "b2", "a3", "a4"]
    assert served(queue, 3) == ["a1", "b1", "a2"]
    # A third principal arriving now starts at the virtual time (10): behind b2, which was
    # there first at 10, ahead of the loud backlog.
    queue.push("c1", "late", cost=10)
    assert served(queue, 4) == ["b2", "c1", "a3", "a4"]
    assert len(queue) == 0


@pytest.mark.parametrize(
    ("weights", "expected"),
    [
        ({}, ["a1", "b1", "a2", "b2", "a3", "b3", "a4", "b4"]),
        # b's weight 2: its requests cost it half as much virtual time.
        ({"b": 2.0}, ["a1", "b1", "b2", "a2", "b3", "b4", "a3", "a4"]),
        ({"a": 3.0}, ["a1", "b1", "a2", "a3", "a4", "b2", "b3", "b4"]),
    ],
    ids=["equal", "b-double", "a-triple"],
)
def test_weights_set_each_principals_share_of_the_slots(
    weights: dict[str, float], expected: list[str]
) -> None:
    queue: FairQueue[str] = FairQueue(lambda p: weights.get(p, 1.0))
    for i in range(1, 5):
        queue.push(f"a{i}", "a", cost=12)
    for i in range(1, 5):
        queue.push(f"b{i}", "b", cost=12)
    assert served(queue, 8) == expected


def test_cost_is_tokens_a_long_request_takes_more_of_the_share() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.push("long", "a", cost=100)
    queue.push("a2", "a", cost=10)
    for i in range(1, 4):
        queue.push(f"b{i}", "b", cost=10)
    # a2 starts at 100 (after its 100-token request), b's at 0, 10, 20.
    assert served(queue, 5) == ["long", "b1", "b2", "b3", "a2"]


def test_one_principal_alone_is_first_come_first_served_and_a_dropped_request_leaves() -> None:
    queue: FairQueue[str] = FairQueue()
    for name, cost in (("r1", 50), ("r2", 1), ("r3", 20)):
        queue.push(name, "only", cost)
    queue.drop("r2")
    assert "r2" not in queue and queue.ordered() == ["r1", "r3"]


@pytest.mark.parametrize(
    ("wants", "weights", "shares"),
    [
        # Room for all: each holds what it wants.
        ({"loud": 3, "q1": 1}, {}, {"loud": 3, "q1": 1}),
        # A loud principal with 10 against three quiet ones with 1 each, 4 rows: one each.
        ({"loud": 10, "q1": 1, "q2": 1, "q3": 1}, {}, {"loud": 1, "q1": 1, "q2": 1, "q3": 1}),
        # Two quiet ones want 1 each: the loud one gets the rest, no row left idle.
        ({"loud": 10, "q1": 1, "q2": 1}, {}, {"loud": 2, "q1": 1, "q2": 1}),
        # Weights 3:1, both flooding: 3 rows to 1.
        ({"a": 9, "b": 9}, {"a": 3.0}, {"a": 3, "b": 1}),
        # One principal alone: every row.
        ({"loud": 10}, {}, {"loud": 4}),
        # Three flooding 4 rows: 4/3 each, rounded up (the fair queue orders who gets the 4th).
        ({"a": 5, "b": 5, "c": 5}, {}, {"a": 2, "b": 2, "c": 2}),
    ],
)
def test_a_full_batchs_rows_are_shared_weighted_max_min(
    wants: dict[str, int], weights: dict[str, float], shares: dict[str, int]
) -> None:
    assert batch_shares(wants, lambda p: weights.get(p, 1.0), rows=4) == shares


def test_a_request_rate_lets_a_burst_in_then_one_per_interval() -> None:
    clock = Clock()
    limiter = Limiter(lambda: Tenancy({"a": Terms(quota=Quota(requests_per_s=2))}), clock)
    for _ in range(int(2 * BURST_S)):
        limiter.admit("a", 5).finished(0)
    with pytest.raises(RateLimitedError) as refused:
        limiter.admit("a", 5)
    assert refused.value.limit == "requests_per_s"
    assert refused.value.retry_after_s == pytest.approx(0.5)
    assert "principal 'a' is over its requests_per_s quota (2)" in str(refused.value)
    limiter.admit("b", 5)  # others are not limited
    clock.now = 0.5
    limiter.admit("a", 5)


def test_generated_tokens_are_paid_when_the_request_ends_and_the_debt_is_waited_out() -> None:
    clock = Clock()
    quota = Quota(generated_tokens_per_min=600)  # 10 a second, 20 in the bucket
    limiter = Limiter(lambda: Tenancy(default=Terms(quota=quota)), clock)
    limiter.admit("a", 1000).finished(50)  # prompt tokens are another limit's
    with pytest.raises(RateLimitedError) as refused:
        limiter.admit("a", 1)
    assert refused.value.limit == "generated_tokens_per_min"
    assert refused.value.retry_after_s == pytest.approx(3.0)  # 30 tokens of debt at 10/s
    clock.now = 3.0
    limiter.admit("a", 1)


def test_requests_at_once_are_limited_until_one_ends() -> None:
    limiter = Limiter(lambda: Tenancy(default=Terms(quota=Quota(concurrent=1))), Clock())
    first = limiter.admit("a", 1)
    with pytest.raises(RateLimitedError) as refused:
        limiter.admit("a", 1)
    assert refused.value.limit == "concurrent" and refused.value.retry_after_s > 0
    first.finished(3)
    first.finished(3)  # once only: a second call frees nothing more
    limiter.admit("a", 1)
    with pytest.raises(RateLimitedError):
        limiter.admit("a", 1)


def test_a_changed_quota_takes_effect_at_the_next_request() -> None:
    clock = Clock()
    tenancy = [Tenancy()]
    limiter = Limiter(lambda: tenancy[0], clock)
    for _ in range(10):
        limiter.admit("a", 1).finished(1)
    tenancy[0] = Tenancy({"a": Terms(quota=Quota(requests_per_s=1))})
    limiter.admit("a", 1).finished(1)
    limiter.admit("a", 1).finished(1)  # a new bucket starts full: BURST_S requests
    with pytest.raises(RateLimitedError):
        limiter.admit("a", 1)
    tenancy[0] = Tenancy()
    limiter.admit("a", 1)


def test_a_closed_loop_flood_gets_its_quota_over_two_minutes_within_five_percent() -> None:
    clock = Clock()
    quota = Quota(generated_tokens_per_min=6000, prompt_tokens_per_min=3000)
    limiter = Limiter(lambda: Tenancy(default=Terms(quota=quota)), clock)
    generated = prompt = 0
    while clock.now < 120:
        try:
            admitted = limiter.admit("loud", 8)
        except RateLimitedError as e:
            clock.now += e.retry_after_s  # the client honours Retry-After
            continue
        prompt += 8
        clock.now += 0.05  # each answer takes 50 ms and generates 16 tokens
        admitted.finished(16)
        generated += 16
    assert generated / 2 == pytest.approx(6000, rel=0.05)
    assert prompt / 2 == pytest.approx(3000, rel=0.05)


def test_terms_split_among_services_enforcing_them_side_by_side() -> None:
    tenancy = Tenancy(
        {"a": Terms(2.0, Quota(requests_per_s=10, generated_tokens_per_min=600, concurrent=3))}
    )
    half = tenancy.split(2).terms("a")
    assert half.weight == 2.0
    assert half.quota == Quota(requests_per_s=5, generated_tokens_per_min=300, concurrent=2)
    with pytest.raises(ConfigurationError, match="shares 0"):
        tenancy.split(0)


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({"principals": {"team-a": {"weight": -1}}}, "principal 'team-a': weight=-1 is not valid"),
        ({"principals": {"team-a": {"concurrent": 2.5}}}, "concurrent=2.5 is not valid"),
        ({"principals": {"team-a": {"requests_per_s": "5"}}}, "requests_per_s='5' is not valid"),
        ({"principals": {"team-a": {"tokens": 5}}}, "unknown field(s) ['tokens']"),
        ({"default": {"requests_per_s": float("inf")}}, "'default': requests_per_s=inf"),
        ({"principals": ["team-a"]}, "'principals' is not an object"),
        ({"team-a": {"weight": 1}}, "is not a tenancy file"),
    ],
)
def test_bad_terms_are_refused_naming_the_value(data: object, named: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        Tenancy.parse(data, "tenancy.json")
    assert named in str(refused.value)


def test_the_file_is_read_again_when_it_changes_and_a_bad_change_keeps_the_last_terms(
    tmp_path: Path,
) -> None:
    path = tmp_path / "tenancy.json"
    path.write_text(json.dumps({"principals": {"a": {"weight": 2}}}))
    clock = Clock()
    terms = TenancyFile(str(path), clock=clock)
    assert terms.current().weight("a") == 2.0 and terms.current().weight("b") == 1.0

    def change(text: str) -> None:
        path.write_text(text)
        os.utime(path, ns=(0, int((clock.now + 100) * 1e9)))  # a new stamp, whatever the fs
        clock.now += RELOAD_S

    change(json.dumps({"principals": {"a": {"weight": 3}}}))
    assert terms.current().weight("a") == 3.0
    change("{not json")
    assert terms.current().weight("a") == 3.0  # the last good terms
    change(json.dumps({"principals": {"a": {"weight": 0}}}))
    assert terms.current().weight("a") == 3.0
    assert TenancyFile(None).current() == Tenancy()
    with pytest.raises(ConfigurationError, match=r"MINT_TENANCY_FILE=.*missing\.json"):
        TenancyFile(str(tmp_path / "missing.json"))
