"""The residency plan: exact host and slot tables after each step of scripted sequences."""

import pytest

from mint_core.errors import ConfigurationError, NotReadyError
from mint_core.planning.residency import (
    HostEntry,
    Residency,
    SlotEntry,
    SlotGrant,
    Tier,
    TierCounters,
)

MB = 1 << 20


def host(*entries: tuple[str, int]) -> list[HostEntry]:
    return [HostEntry(key, size * MB) for key, size in entries]


def slots(*entries: tuple[int, str, int]) -> list[SlotEntry]:
    return [SlotEntry(slot, key, pins) for slot, key, pins in entries]


def weights(key: str) -> str:
    """Stand-in weights: the plan holds whatever the worker gives it."""
    return f"weights of {key}"


def test_load_hit_evict_pin_unpin_step_by_step() -> None:
    plan: Residency[str] = Residency(host_capacity_bytes=10 * MB, device_slots=2)
    for key in ("a", "b", "c"):
        assert plan.put_host(key, weights(key), 3 * MB) == []
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

    # Unpin everything; a fourth revision overflows the host cache (10 MB): the least recently
    # used, b, leaves it.
    plan.release("a")
    plan.release("a")
    plan.release("c")
    assert plan.slot_table() == slots((1, "a", 0), (2, "c", 0))
    assert plan.put_host("d", weights("d"), 3 * MB) == ["b"]
    assert plan.host_table() == host(("a", 3), ("c", 3), ("d", 3))

    # Evicting from the host frees the revision's slot too (the tiers are inclusive).
    assert plan.put_host("e", weights("e"), 4 * MB) == ["a"]
    assert plan.host_table() == host(("c", 3), ("d", 3), ("e", 4))
    assert plan.slot_table() == slots((2, "c", 0))
    with pytest.raises(NotReadyError, match="a is not in this worker's host cache"):
        plan.acquire("a")

    assert plan.counters == {
        Tier.HOST: TierCounters(hits=3, misses=1, loads=5, evictions=2),
        Tier.DEVICE: TierCounters(hits=1, misses=3, loads=3, evictions=1),
    }


def test_a_pinned_revision_is_never_evicted_from_either_tier() -> None:
    plan: Residency[str] = Residency(host_capacity_bytes=6 * MB, device_slots=1)
    plan.put_host("busy", weights("busy"), 3 * MB)
    plan.put_host("idle", weights("idle"), 3 * MB)
    assert plan.acquire("busy") == SlotGrant("busy", 1, load=True)

    # busy is the least recently used, but pinned: idle leaves instead.
    assert plan.put_host("new", weights("new"), 3 * MB) == ["idle"]
    assert plan.host_table() == host(("busy", 3), ("new", 3))
    assert plan.acquire("new") is None
    assert plan.slot_table() == slots((1, "busy", 1))
    assert plan.drop_host("busy") is False

    # Nothing unpinned is left to evict: the new revision is refused and nothing moves.
    with pytest.raises(ConfigurationError, match="raise the host cache capacity"):
        plan.put_host("huge", weights("huge"), 5 * MB)
    assert plan.host_table() == host(("busy", 3), ("new", 3))

    plan.release("busy")
    assert plan.acquire("new") == SlotGrant("new", 1, load=True, evicted="busy")
    assert plan.slot_table() == slots((1, "new", 1))
    with pytest.raises(ConfigurationError, match="busy holds no pinned device slot"):
        plan.release("busy")


def test_a_revision_left_while_pinned_goes_at_its_last_release() -> None:
    plan: Residency[str] = Residency(host_capacity_bytes=6 * MB, device_slots=2)
    plan.put_host("failed", weights("failed"), 3 * MB)
    plan.put_host("kept", weights("kept"), 3 * MB)
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
    plan.put_host("again", weights("again"), 3 * MB)
    plan.acquire("again")
    plan.leave("again")
    assert plan.put_host("again", weights("again"), 3 * MB) == []
    assert plan.release("again") is False
    assert plan.host_table() == host(("again", 3))


def test_the_host_cache_holds_weights_exactly_as_long_as_its_table_lists_them() -> None:
    plan: Residency[str] = Residency(host_capacity_bytes=4 * MB, device_slots=1)
    plan.put_host("a", weights("a"), 3 * MB)
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
    assert plan.put_host("b", weights("b"), 4 * MB) == ["a"]
    with pytest.raises(NotReadyError, match="a is not in this worker's host cache"):
        plan.host_weights("a")
    assert plan.drop_host("b") is True
    assert plan.host_table() == []
    with pytest.raises(NotReadyError, match="b is not in this worker's host cache"):
        plan.host_weights("b")


@pytest.mark.parametrize(
    ("capacity", "slots_", "message"),
    [(0, 4, "capacity 0 bytes must be positive"), (MB, 0, "device_slots=0 must be at least 1")],
)
def test_bad_capacities_are_refused(capacity: int, slots_: int, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Residency(capacity, slots_)


def test_a_host_tier_counted_in_revisions_evicts_the_least_recently_used() -> None:
    """vLLM's host cache counts adapters (`--max-cpu-loras`), whatever their bytes."""
    residency: Residency[str] = Residency(1 << 30, device_slots=2, host_capacity_entries=2)
    assert residency.put_host("a:r1", "a", 10) == []
    assert residency.put_host("b:r1", "b", 10) == []
    assert residency.put_host("a:r1", "a", 10) == []  # a hit: now the most recently used
    assert residency.put_host("c:r1", "c", 10) == ["b:r1"]
    assert [entry.key for entry in residency.host_table()] == ["a:r1", "c:r1"]
    assert residency.acquire("a:r1") is not None and residency.acquire("c:r1") is not None
    with pytest.raises(ConfigurationError, match="holds at most 2 revisions"):
        residency.put_host("d:r1", "d", 10)  # both pinned by running requests
