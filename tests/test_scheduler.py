"""Continuous batching: requests join and leave a running batch, each row computing what it
would alone, sampling per request, and more adapters in flight than device slots."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from mint_core.base_model import load_base
from mint_core.errors import ConfigurationError
from mint_core.residency import Residency, Tier
from mint_core.textgen import FinishReason
from serving.engine import BASE, AdapterWeights, TorchEngine
from serving.metrics import WorkerMetrics
from serving.sampling import SamplingParams
from serving.scheduler import Request, Scheduler, TokenEvent
from tests.helpers import ENGINE_PROMPTS as PROMPTS
from tests.helpers import ENGINE_SPEC as SPEC
from tests.helpers import config_of, random_adapter, weights_of

ADAPTERS = 5


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("scheduler-home")


@pytest.fixture(scope="module")
def adapters(home: Path) -> dict[str, AdapterWeights]:
    """Random adapters of ranks 1 to 5, checked against the base."""
    checker = TorchEngine(load_base(SPEC, home))
    weights = {}
    for number in range(ADAPTERS):
        lora, model = random_adapter(load_base(SPEC, home), rank=number + 1, seed=number)
        weights[f"a{number}"] = checker.prepare(f"a{number}", config_of(lora), weights_of(model))
    return weights


@pytest.fixture(scope="module")
def reference(home: Path, adapters: dict[str, AdapterWeights]) -> TorchEngine:
    """An engine holding every adapter, run one request at a time: the expected answers."""
    engine = TorchEngine(load_base(SPEC, home), slots=ADAPTERS)
    for weights in adapters.values():
        engine.load(weights)
    return engine


def scheduler_for(
    adapters: dict[str, AdapterWeights], home: Path, slots: int
) -> Iterator[Scheduler]:
    engine = TorchEngine(load_base(SPEC, home), slots=slots)
    host = dict(adapters)
    residency = Residency(host_capacity_bytes=1 << 30, device_slots=slots)
    for weights in host.values():
        residency.put_host(weights.key, weights.nbytes)
    scheduler = Scheduler(engine, residency, host.__getitem__, WorkerMetrics(residency))
    yield scheduler
    scheduler.stop()


@pytest.fixture
def scheduler(adapters: dict[str, AdapterWeights], home: Path) -> Iterator[Scheduler]:
    yield from scheduler_for(adapters, home, slots=ADAPTERS)


def submit(scheduler: Scheduler, prompt: str, key: str, **params: object) -> Request:
    ids = scheduler.engine.tokenizer.encode(prompt)
    return scheduler.submit(ids, key, SamplingParams(**params))  # type: ignore[arg-type]


def alone(reference: TorchEngine, prompt: str, key: str, tokens: int) -> tuple[int, ...]:
    return reference.generate([prompt], [key], tokens)[0].token_ids


def test_requests_join_a_running_batch_and_leave_it_each_as_if_alone(
    scheduler: Scheduler, reference: TorchEngine
) -> None:
    # The long request must not end early (end-of-sequence) for the overlap to show.
    long_key, long_prompt = next(
        (key, prompt)
        for key in ["a0", "a1", "a2", "a3", "a4", BASE]
        for prompt in PROMPTS
        if len(alone(reference, prompt, key, 40)) == 40
    )
    first = submit(scheduler, long_prompt, long_key, max_new_tokens=40)
    events = first.events()
    for _ in range(3):  # it is running: three tokens are out
        assert isinstance(next(events), TokenEvent)
    keys = ["a0", "a1", BASE, "a2", "a3", "a4", "a1"]
    later = [submit(scheduler, PROMPTS[i], key, max_new_tokens=4 + i) for i, key in enumerate(keys)]

    results = [r.result(timeout_s=60) for r in later]
    long_result = first.result(timeout_s=60)
    assert long_result.token_ids == alone(reference, long_prompt, long_key, 40)
    for i, (key, result) in enumerate(zip(keys, results, strict=True)):
        assert result.token_ids == alone(reference, PROMPTS[i], key, 4 + i), key
    # The later requests joined while the first ran, and left before it finished.
    assert first.joined_step is not None and first.left_step is not None
    for request in later:
        assert request.joined_step is not None and request.left_step is not None
        assert first.joined_step < request.joined_step < first.left_step
        assert request.left_step < first.left_step
    assert all(entry.pins == 0 for entry in scheduler.residency.slot_table())


def test_sampling_is_per_request_and_seeded(scheduler: Scheduler, reference: TorchEngine) -> None:
    sampled = {"temperature": 1.0, "top_p": 0.9, "seed": 1234, "max_new_tokens": 16}
    quiet = submit(scheduler, PROMPTS[0], "a2", **sampled).result(timeout_s=60)
    # The same seed in a batch full of other work gives the same tokens.
    noise = [submit(scheduler, p, "a0", temperature=1.5, max_new_tokens=12) for p in PROMPTS]
    busy = submit(scheduler, PROMPTS[0], "a2", **sampled)
    assert busy.result(timeout_s=60).token_ids == quiet.token_ids
    assert quiet.seed == 1234
    other = submit(scheduler, PROMPTS[0], "a2", **(sampled | {"seed": 99})).result(timeout_s=60)
    assert other.token_ids != quiet.token_ids
    for request in noise:
        request.result(timeout_s=60)

    # top_k=1 samples the greedy token.
    top1 = submit(scheduler, PROMPTS[1], "a3", temperature=1.0, top_k=1, max_new_tokens=10)
    assert top1.result(timeout_s=60).token_ids == alone(reference, PROMPTS[1], "a3", 10)

    # A stop sequence ends the text right after it.
    greedy = submit(scheduler, PROMPTS[2], "a1", max_new_tokens=20).result(timeout_s=60)
    stop = greedy.text[4:6]
    stopped = submit(scheduler, PROMPTS[2], "a1", max_new_tokens=20, stop=("~~~", stop))
    result = stopped.result(timeout_s=60)
    assert result.finish_reason is FinishReason.STOP_SEQUENCE
    assert result.text == greedy.text[: greedy.text.index(stop) + len(stop)]


def test_more_adapters_in_flight_than_slots_queue_instead_of_failing(
    adapters: dict[str, AdapterWeights], reference: TorchEngine, home: Path
) -> None:
    for scheduler in scheduler_for(adapters, home, slots=2):
        keys = [f"a{n % ADAPTERS}" for n in range(12)]
        requests = [
            submit(scheduler, PROMPTS[n % len(PROMPTS)], key, max_new_tokens=6)
            for n, key in enumerate(keys)
        ]
        for n, (key, request) in enumerate(zip(keys, requests, strict=True)):
            expected = alone(reference, PROMPTS[n % len(PROMPTS)], key, 6)
            assert request.result(timeout_s=60).token_ids == expected
        residency = scheduler.residency
        device = residency.counters[Tier.DEVICE]
        assert device.loads >= ADAPTERS and device.evictions >= ADAPTERS - 2
        assert len(residency.slot_table()) == 2
        assert all(entry.pins == 0 for entry in residency.slot_table())


def test_a_request_longer_than_the_base_allows_is_refused(scheduler: Scheduler) -> None:
    with pytest.raises(ConfigurationError, match="exceeds the base model's 64 positions"):
        submit(scheduler, "x" * 60, BASE, max_new_tokens=10)
    with pytest.raises(ConfigurationError, match=r"top_p=1\.5"):
        SamplingParams(top_p=1.5)
