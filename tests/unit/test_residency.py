"""The residency plan: exact host and slot tables after each step of scripted sequences."""

import pytest

from mint_core.errors import ConfigurationError, NotReadyError
from mint_core.planning.residency import (
    FRESH_S,
    HostEntry,
    HostTierFull,
    Residency,
    SlotEntry,
    SlotGrant,
    Tier,
    TierCounters,
)

MB = 1 << 20


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def plan_of(capacity: int, slots: int, entries: int | None = None) -> tuple[Residency[str], Clock]:
    clock = Clock()
    return Residency(capacity, slots, entries, half_life_s=100.0, clock=clock), clock


def put(plan: Residency[str], key: str, nbytes: int) -> list[str]:
    """Take `key` in as a worker's prewarm does: put, then settle once it is ready."""
    evicted = plan.put_host(key, weights(key), nbytes)
    plan.settle(key)
    return evicted


def host(*entries: tuple[str, int]) -> list[HostEntry]:
    return [HostEntry(key, size * MB) for key, size in entries]


def slots(*entries: tuple[int, str, int]) -> list[SlotEntry]:
    return [SlotEntry(slot, key, pins) for slot, key, pins in entries]


def weights(key: str) -> str:
    """Stand-in weights: the plan holds whatever the worker gives it."""
    return f"weights of {key}"


def test_load_hit_evict_pin_unpin_step_by_step() -> None:
    plan, clock = plan_of(10 * MB, slots=2)
    for key in ("a", "b", "c"):
        assert put(plan, key, 3 * MB) == []
    assert plan.host_table() == host(("a", 3), ("b", 3), ("c", 3))

    # Load: a free slot for each of a and b.
    assert plan.acquire("a") == SlotGrant("a", 1, load=True)
    assert plan.acquire("b") == SlotGrant("b", 2, load=True)
    assert plan.slot_table() == slots((1, "a", 1), (2, "b", 1))
    # Hit: a second request for a shares its slot; host LRU order follows use.
    assert plan.acquire("a") == SlotGrant("a", 1, load=False)
    assert plan.slot_table() == slots((1, "a", 2), (2, "b", 1))
    assert plan.host_table() == host(("c", 3), ("b", 3), ("a", 3))

    # Pinned: every slot is in use, so c waits (None) rather than evicting anyone.
    assert plan.acquire("c") is None
    assert plan.slot_table() == slots((1, "a", 2), (2, "b", 1))

    # Unpin b: c takes b's slot, the least recently used unpinned one.
    plan.release("b")
    assert plan.slot_table() == slots((1, "a", 2), (2, "b", 0))
    assert plan.acquire("c") == SlotGrant("c", 2, load=True, evicted="b")
    assert plan.slot_table() == slots((1, "a", 2), (2, "c", 1))

    # Unpin everything; a fourth revision overflows the host cache (10 MB): of b and c, used
    # as often, b was used less recently and leaves.
    plan.release("a")
    plan.release("a")
    plan.release("c")
    assert plan.slot_table() == slots((1, "a", 0), (2, "c", 0))
    clock.now += 1
    assert put(plan, "d", 3 * MB) == ["b"]
    assert plan.host_table() == host(("a", 3), ("c", 3), ("d", 3))

    # d is fresh (not used yet by the request that brought it): c, used once, leaves for e.
    assert put(plan, "e", 4 * MB) == ["c"]
    assert plan.host_table() == host(("a", 3), ("d", 3), ("e", 4))
    assert plan.slot_table() == slots((1, "a", 0))  # evicting from the host frees the slot
    with pytest.raises(NotReadyError, match="c is not in this worker's host cache"):
        plan.acquire("c")

    assert plan.counters == {
        Tier.HOST: TierCounters(hits=3, misses=1, loads=5, evictions=2),
        Tier.DEVICE: TierCounters(hits=1, misses=3, loads=3, evictions=1),
    }


def test_the_host_tier_keeps_what_is_used_often_and_recently() -> None:
    """LRFU: each use adds one to a score that halves every half-life (100 s here)."""
    plan, clock = plan_of(1 << 30, slots=4, entries=3)
    for key in ("often", "once", "recent"):
        put(plan, key, 10)
    for _ in range(5):
        use(plan, "often")
    use(plan, "once")
    clock.now += 50
    use(plan, "recent")
    # often: 6 * 0.71 = 4.2, once: 2 * 0.71 = 1.4, recent: 2 (used now).
    assert put(plan, "new", 10) == ["once"]
    use(plan, "new")
    # A long time later the old favourite has faded below what was used just now.
    clock.now += 400
    use(plan, "recent")
    use(plan, "new")
    assert put(plan, "newer", 10) == ["often"]


def test_warming_fresh_pinned_and_protected_revisions_stay() -> None:
    plan, clock = plan_of(1 << 30, slots=2, entries=2)
    plan.put_host("warming", weights("warming"), 10)  # not settled: still warming up
    put(plan, "fresh", 10)  # settled, not yet used by the request that brought it
    with pytest.raises(HostTierFull, match="new does not fit in the host cache now"):
        plan.put_host("new", weights("new"), 10)
    assert [e.key for e in plan.host_table()] == ["warming", "fresh"]

    # A fresh revision unused for FRESH_S may go; a warming one never.
    clock.now += FRESH_S
    assert put(plan, "new", 10) == ["fresh"]
    plan.settle("warming")
    use(plan, "warming")
    use(plan, "new")
    plan.protect(["new"])  # the worker's pins
    assert plan.acquire("warming") is not None  # a request running on it
    with pytest.raises(HostTierFull, match="serving, warming or pinned"):
        plan.put_host("other", weights("other"), 10)
    plan.release("warming")
    assert put(plan, "other", 10) == ["warming"]
    assert plan.room() == 0
    assert plan.drop_host("other") and plan.room() == 1


def test_a_revision_settled_unfresh_may_leave_at_once() -> None:
    """A prefill (room nobody asked for) settles unfresh: a request's revision takes its room
    at once instead of waiting FRESH_S for a first use that no request will bring."""
    plan, _ = plan_of(1 << 30, slots=2, entries=2)
    for key in ("prefill-1", "prefill-2"):
        plan.put_host(key, weights(key), 10)
        plan.settle(key, fresh=False)
    assert put(plan, "wanted", 10) == ["prefill-1"]
    assert put(plan, "wanted-too", 10) == ["prefill-2"]
    with pytest.raises(HostTierFull):  # both fresh now: each waits for its request
        plan.put_host("third", weights("third"), 10)


def use(plan: Residency[str], key: str) -> None:
    """One request for `key`, start to end."""
    assert plan.acquire(key) is not None
    plan.release(key)


def test_a_pinned_revision_is_never_evicted_from_either_tier() -> None:
    plan, clock = plan_of(6 * MB, slots=1)
    put(plan, "busy", 3 * MB)
    put(plan, "idle", 3 * MB)
    assert plan.acquire("busy") == SlotGrant("busy", 1, load=True)
    assert plan.acquire("idle") is None  # every slot is pinned: it waits

    # busy is used more, but pinned: idle leaves for new, whatever its score.
    plan.release("busy")
    assert plan.acquire("busy") == SlotGrant("busy", 1, load=False)
    clock.now += FRESH_S  # idle's request never got its slot
    assert put(plan, "new", 3 * MB) == ["idle"]
    assert plan.host_table() == host(("busy", 3), ("new", 3))
    assert plan.acquire("new") is None
    assert plan.slot_table() == slots((1, "busy", 1))
    assert plan.drop_host("busy") is False

    # Nothing that may leave is left: the new revision is refused and nothing moves.
    with pytest.raises(HostTierFull, match="huge does not fit in the host cache now"):
        plan.put_host("huge", weights("huge"), 5 * MB)
    with pytest.raises(ConfigurationError, match="more than all of it"):
        plan.put_host("huger", weights("huger"), 7 * MB)
    assert plan.host_table() == host(("busy", 3), ("new", 3))

    plan.release("busy")
    assert plan.acquire("new") == SlotGrant("new", 1, load=True, evicted="busy")
    assert plan.slot_table() == slots((1, "new", 1))
    with pytest.raises(ConfigurationError, match="busy holds no pinned device slot"):
        plan.release("busy")


def test_a_revision_left_while_pinned_goes_at_its_last_release() -> None:
    plan, _ = plan_of(6 * MB, slots=2)
    put(plan, "failed", 3 * MB)
    put(plan, "kept", 3 * MB)
    plan.acquire("failed")
    plan.acquire("failed")
    assert plan.leave("failed") is False  # two requests pin it: they finish on its weights
    assert plan.host_table() == host(("kept", 3), ("failed", 3))  # used last
    with pytest.raises(NotReadyError, match="failed is not in this worker's host cache"):
        plan.acquire("failed")  # no new request takes it up meanwhile
    assert plan.release("failed") is False
    assert plan.release("failed") is True  # the last one: gone from both tiers
    assert plan.host_table() == host(("kept", 3)) and plan.slot_table() == []
    assert plan.leave("kept") is True and plan.host_table() == []

    # Taken in again before its last release: it stays.
    put(plan, "again", 3 * MB)
    plan.acquire("again")
    plan.leave("again")
    assert plan.put_host("again", weights("again"), 3 * MB) == []
    assert plan.release("again") is False
    assert plan.host_table() == host(("again", 3))


def test_the_host_cache_holds_weights_exactly_as_long_as_its_table_lists_them() -> None:
    plan, clock = plan_of(4 * MB, slots=1)
    put(plan, "a", 3 * MB)
    assert plan.host_weights("a") == weights("a")
    assert plan.put_host("a", "other weights", 3 * MB) == []  # held already: kept as it was
    assert plan.host_weights("a") == weights("a")

    # Too big even with a evicted: refused, and nothing of it is kept.
    with pytest.raises(ConfigurationError, match="big needs 5242880 bytes of host cache"):
        plan.put_host("big", weights("big"), 5 * MB)
    assert plan.host_table() == host(("a", 3))
    with pytest.raises(NotReadyError, match="big is not in this worker's host cache"):
        plan.host_weights("big")

    # Evicted and dropped weights leave with their entries.
    clock.now += FRESH_S
    assert put(plan, "b", 4 * MB) == ["a"]
    with pytest.raises(NotReadyError, match="a is not in this worker's host cache"):
        plan.host_weights("a")
    assert plan.drop_host("b") is True
    assert plan.host_table() == [] and plan.host_bytes == 0
    with pytest.raises(NotReadyError, match="b is not in this worker's host cache"):
        plan.host_weights("b")


@pytest.mark.parametrize(
    ("capacity", "slots_", "message"),
    [(0, 4, "capacity 0 bytes must be positive"), (MB, 0, "device_slots=0 must be at least 1")],
)
def test_bad_capacities_are_refused(capacity: int, slots_: int, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Residency(capacity, slots_)


def test_a_host_tier_counted_in_revisions_never_holds_more() -> None:
    """vLLM's host cache counts adapters (`--max-cpu-loras`), and so does MINT_HOST_ADAPTERS
    on either backend, whatever their bytes."""
    residency, _ = plan_of(1 << 30, slots=2, entries=2)
    assert put(residency, "a:r1", 10) == []
    assert put(residency, "b:r1", 10) == []
    use(residency, "a:r1")
    use(residency, "b:r1")
    use(residency, "a:r1")  # used more often: b leaves first
    assert put(residency, "c:r1", 10) == ["b:r1"]
    assert [entry.key for entry in residency.host_table()] == ["a:r1", "c:r1"]
    assert residency.acquire("a:r1") is not None and residency.acquire("c:r1") is not None
    with pytest.raises(HostTierFull, match="2 of 2 revisions"):
        residency.put_host("d:r1", "d", 10)  # both pinned by running requests
