"""Placement (rendezvous hashing) and demand (replicas for hot revisions)."""

from collections import Counter

import pytest

from mint_core.errors import ConfigurationError
from mint_core.planning.placement import Demand, place, ranking

WORKERS = [f"http://10.0.0.{n}:8000" for n in range(1, 11)]
REVISIONS = [f"adapter-{n}:r1" for n in range(20_000)]


def test_placement_is_a_function_of_the_revision_and_the_set_of_workers() -> None:
    for revision in REVISIONS[:200]:
        assert place(revision, WORKERS) == place(revision, list(reversed(WORKERS)))
        assert place(revision, WORKERS, 3) == tuple(ranking(revision, WORKERS)[:3])
    assert place("a:r1", WORKERS, 20) == tuple(ranking("a:r1", WORKERS))  # at most all of them
    with pytest.raises(ConfigurationError, match="replicas=0 must be at least 1"):
        place("a:r1", WORKERS, 0)


def test_revisions_spread_evenly_over_the_workers() -> None:
    load = Counter(place(revision, WORKERS)[0] for revision in REVISIONS)
    mean = len(REVISIONS) / len(WORKERS)
    assert set(load) == set(WORKERS)
    assert max(load.values()) / mean < 1.1  # 2,000 each; sqrt(2000) = 45 is one sigma


def test_a_worker_joining_or_leaving_moves_only_its_share() -> None:
    before = {revision: place(revision, WORKERS)[0] for revision in REVISIONS}
    joined = [*WORKERS, "http://10.0.0.99:8000"]
    after = {revision: place(revision, joined)[0] for revision in REVISIONS}
    moved = [r for r in REVISIONS if before[r] != after[r]]
    assert all(after[r] == "http://10.0.0.99:8000" for r in moved)  # only to the new worker
    assert abs(len(moved) / len(REVISIONS) - 1 / len(joined)) < 0.02

    gone = WORKERS[3]
    left = {
        revision: place(revision, [w for w in WORKERS if w != gone])[0] for revision in REVISIONS
    }
    moved = [r for r in REVISIONS if before[r] != left[r]]
    assert moved == [r for r in REVISIONS if before[r] == gone]  # only the leaver's
    # ... each to the worker it ranked next.
    assert all(left[r] == ranking(r, WORKERS)[1] for r in moved)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_hot_revision_gets_replicas_and_gives_them_up_when_it_cools() -> None:
    clock = Clock()
    demand = Demand(hot_rate=10.0, half_life_s=5.0, clock=clock)
    assert demand.replicas("cold:r1", own=1, workers=4) == 1  # never requested

    def requests(revision: str, rate: float, seconds: float) -> None:
        for _ in range(int(rate * seconds)):
            clock.now += 1 / rate
            demand.started(revision)
            demand.finished(revision)

    requests("hot:r1", rate=35.0, seconds=30)
    assert demand.rate("hot:r1") == pytest.approx(35.0, rel=0.05)
    grown = [demand.replicas("hot:r1", own=1, workers=4) for _ in range(5)]
    assert grown == [2, 3, 4, 4, 4]  # one more each time it is asked, up to the workers
    assert demand.replicas("hot:r1", own=1, workers=2) == 2

    # Down to 12/s: under half of 4 replicas' worth, so one goes; not under half of 3's.
    requests("hot:r1", rate=12.0, seconds=60)
    assert [demand.replicas("hot:r1", own=1, workers=4) for _ in range(3)] == [3, 3, 3]
    requests("hot:r1", rate=4.0, seconds=60)  # under half of 2 replicas' worth, then of 1's
    assert [demand.replicas("hot:r1", own=1, workers=4) for _ in range(3)] == [2, 1, 1]
    clock.now += 120  # quiet
    assert [demand.replicas("hot:r1", own=1, workers=4) for _ in range(2)] == [1, 1]


def test_requests_in_flight_make_a_revision_hot_too() -> None:
    demand = Demand(hot_rate=1000.0, hot_in_flight=4, clock=Clock())
    for _ in range(5):
        demand.started("slow:r1")
    assert demand.replicas("slow:r1", own=1, workers=3) == 2
    for _ in range(5):
        demand.finished("slow:r1")
    assert demand.replicas("slow:r1", own=1, workers=3) == 1


def test_demand_forgets_the_least_recently_requested_beyond_its_bound() -> None:
    demand = Demand(hot_rate=1.0, tracked=100, clock=Clock())
    for revision in REVISIONS[:1000]:
        demand.started(revision)
    assert demand.rate(REVISIONS[0]) == 0.0 and demand.rate(REVISIONS[999]) > 0
