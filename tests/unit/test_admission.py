"""The admission plan: at most K prewarming, rollbacks first, first come first served."""

import pytest

from mint_core.errors import ConfigurationError
from mint_core.planning.admission import AdmissionQueue, Priority


def test_at_most_k_prewarm_and_the_rest_wait_in_order() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue(concurrency=2)
    for key in ("a", "b", "c", "d"):
        assert queue.push(key)
    assert queue.push("a") is False  # already queued
    assert (queue.start_next(), queue.start_next(), queue.start_next()) == ("a", "b", None)
    assert queue.prewarming == {"a", "b"}
    assert queue.waiting == ["c", "d"]
    assert (queue.position("c"), queue.position("d"), queue.position("a")) == (0, 1, None)
    assert queue.push("a") is False  # prewarming

    queue.finish("a")
    assert queue.start_next() == "c"
    assert queue.start_next() is None


def test_a_rollback_jumps_the_queue_and_a_queued_revision_can_be_moved_up() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue()
    for key in ("new-1", "new-2", "new-3"):
        queue.push(key)
    queue.push("old", Priority.ROLLBACK)
    assert queue.waiting == ["old", "new-1", "new-2", "new-3"]
    assert queue.push("new-3", Priority.ROLLBACK)
    assert queue.waiting == ["old", "new-3", "new-1", "new-2"]
    assert queue.push("new-3", Priority.NORMAL) is False  # never moved down
    assert [queue.start_next() for _ in range(2)] == ["old", None]


def test_a_prefill_goes_last_and_a_request_for_it_while_it_prewarms_raises_it() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue(concurrency=2)
    queue.push("placed", Priority.PREFILL)
    queue.push("new")
    assert [queue.start_next(), queue.start_next()] == ["new", "placed"]
    assert (queue.started_as("new"), queue.started_as("placed")) == (
        Priority.NORMAL,
        Priority.PREFILL,
    )
    assert queue.push("placed", Priority.DEMAND) is False  # prewarming: not queued again
    assert queue.started_as("placed") is Priority.DEMAND  # but now a request waits for it
    assert queue.push("placed", Priority.PREFILL) is False
    assert queue.started_as("placed") is Priority.DEMAND  # never moved down
    queue.finish("placed")
    assert queue.started_as("placed") is None


def test_concurrency_must_be_positive() -> None:
    with pytest.raises(ConfigurationError, match="MINT_ADMISSION_K"):
        AdmissionQueue(concurrency=0)
