"""Continuous batching: requests join and leave a running batch, each row computing what it
would alone, sampling per request, and more adapters in flight than device slots; a row whose
adapter gives NaN, or a step that raises, answers every request it holds and unpins its slot."""

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mint_core.errors import ConfigurationError, MintError
from mint_core.model.generate import FinishReason, Generation
from mint_core.model.tiny import EOS, IM_END
from mint_core.planning.residency import Residency, Tier
from serving.engine.engine import BASE, AdapterWeights, TorchEngine
from serving.engine.generation import Generating, TokenEvent
from serving.engine.sampling import SamplingParams
from serving.engine.scheduler import Scheduler
from serving.metrics import WorkerMetrics
from tests.helpers import ENGINE_PROMPTS as PROMPTS
from tests.helpers import ENGINE_SPEC as SPEC
from tests.helpers import config_of, random_adapter, tiny_base, weights_of

ADAPTERS = 5


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("scheduler-home")


@pytest.fixture(scope="module")
def adapters(home: Path) -> dict[str, AdapterWeights]:
    """Random adapters of ranks 1 to 5, checked against the base."""
    checker = TorchEngine(tiny_base(SPEC, home))
    weights = {}
    for number in range(ADAPTERS):
        lora, model = random_adapter(tiny_base(SPEC, home), rank=number + 1, seed=number)
        weights[f"a{number}"] = checker.prepare(f"a{number}", config_of(lora), weights_of(model))
    return weights


@pytest.fixture(scope="module")
def reference(home: Path, adapters: dict[str, AdapterWeights]) -> TorchEngine:
    """An engine holding every adapter, run one request at a time: the expected answers."""
    engine = TorchEngine(tiny_base(SPEC, home), slots=ADAPTERS)
    for weights in adapters.values():
        engine.load(weights)
    return engine


def scheduler_for(
    adapters: dict[str, AdapterWeights], home: Path, slots: int
) -> Iterator[Scheduler]:
    engine = TorchEngine(tiny_base(SPEC, home), slots=slots)
    residency: Residency[AdapterWeights] = Residency(1 << 30, device_slots=slots)
    for weights in adapters.values():
        residency.put_host(weights.key, weights, weights.nbytes)
    scheduler = Scheduler(engine, residency, WorkerMetrics(residency))
    yield scheduler
    scheduler.stop()


@pytest.fixture
def scheduler(adapters: dict[str, AdapterWeights], home: Path) -> Iterator[Scheduler]:
    yield from scheduler_for(adapters, home, slots=ADAPTERS)


def submit(scheduler: Scheduler, prompt: str, key: str, **params: Any) -> Generating:
    ids = scheduler.engine.codec.encode(prompt)
    return scheduler.submit(ids, key, SamplingParams(**params))


def alone(reference: TorchEngine, prompt: str, key: str, tokens: int) -> tuple[int, ...]:
    return reference.generate([prompt], [key], tokens)[0].token_ids


def test_requests_join_a_running_batch_and_leave_it_each_as_if_alone(
    scheduler: Scheduler, reference: TorchEngine
) -> None:
    # The long request must not end early (end-of-sequence) for the overlap to show.
    long_key, long_prompt = long_running(reference)
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


def test_a_request_longer_than_the_context_or_empty_is_refused(scheduler: Scheduler) -> None:
    # 120 letters and BOS, and 8 new tokens, are one more than the context of 128.
    assert scheduler.engine.base.context_length == 128
    with pytest.raises(
        ConfigurationError,
        match=r"prompt's 121 tokens plus max_new_tokens=8 do not fit the context of the base "
        r"model \S+ \(128 tokens\)",
    ):
        submit(scheduler, "x" * 120, BASE, max_new_tokens=8)
    submit(scheduler, "x" * 120, BASE, max_new_tokens=7).result(timeout_s=60)
    with pytest.raises(ConfigurationError, match="the prompt is empty"):
        scheduler.submit([], BASE, SamplingParams())
    with pytest.raises(ConfigurationError, match=r"top_p=1\.5"):
        SamplingParams(top_p=1.5)


@pytest.mark.parametrize(
    ("end", "params", "pieces", "reason"),
    [
        (EOS, {}, ["", "é", "", "", "中", "", "", "", "😀", ""], FinishReason.EOS_TOKEN),
        (IM_END, {}, ["", "é", "", "", "中", "", "", "", "😀", ""], FinishReason.EOS_TOKEN),
        # Cut inside 中 by the length limit: the last piece flushes what was held back.
        (EOS, {"max_new_tokens": 4}, ["", "é", "", "\ufffd"], FinishReason.LENGTH),
        (EOS, {"stop": ("中",)}, ["", "é", "", "", "中"], FinishReason.STOP_SEQUENCE),
    ],
)
def test_a_request_ends_at_any_end_id_and_its_pieces_add_up_to_its_text(
    reference: TorchEngine,
    end: str,
    params: dict[str, Any],
    pieces: list[str],
    reason: FinishReason,
) -> None:
    codec = reference.codec
    # One token per byte: é is 2 tokens, 中 3 and 😀 4.
    answer = codec.tokenizer("é中😀", add_special_tokens=False)["input_ids"]
    tokens = [*answer, codec.tokenizer.convert_tokens_to_ids(end)]
    assert len(tokens) == 10 and tokens[-1] in codec.eos_ids
    request = Generating([1], BASE, SamplingParams(**({"max_new_tokens": 20} | params)), codec)
    ended = [request.push(token, -1.0) for token in tokens[: len(pieces)]]
    assert ended == [False] * (len(pieces) - 1) + [True]
    *events, generation = request.events(timeout_s=1)
    assert isinstance(generation, Generation)
    assert [e.text for e in events if isinstance(e, TokenEvent)] == pieces
    assert generation.text == "".join(pieces) == codec.decode(tokens[: len(pieces)])
    assert generation.finish_reason is reason


def long_running(
    reference: TorchEngine, keys: tuple[str, ...] = ("a0", "a1", "a2", "a3", "a4", BASE)
) -> tuple[str, str]:
    """One of `keys` and a prompt whose answer does not end (end-of-sequence) before 40 tokens."""
    return next(
        (key, prompt)
        for key in keys
        for prompt in PROMPTS
        if len(alone(reference, prompt, key, 40)) == 40
    )


def settle(scheduler: Scheduler) -> None:
    """Run one more request through the loop: every request that ended before it has been
    retired (its slot unpinned) once it answers."""
    submit(scheduler, PROMPTS[0], BASE, max_new_tokens=1).result(timeout_s=60)


def with_nan(weights: AdapterWeights, key: str) -> AdapterWeights:
    """`weights` under another key with one NaN in one tensor: a bit flipped in memory after
    every check."""
    module, (a, b, scaling) = next(iter(weights.pairs.items()))
    a = a.clone()
    a[0, 0] = float("nan")
    return AdapterWeights(key, {**weights.pairs, module: (a, b, scaling)})


def test_a_nan_adapter_fails_its_own_requests_and_no_one_elses(
    adapters: dict[str, AdapterWeights], reference: TorchEngine, home: Path
) -> None:
    host = {**adapters, "bad": with_nan(adapters["a1"], "bad")}
    for scheduler in scheduler_for(host, home, slots=len(host)):
        # Every adapter in a slot first, so that the mix below joins in one step (a step copies
        # at most one adapter into a slot).
        for key in host:
            with contextlib.suppress(MintError):
                submit(scheduler, PROMPTS[0], key, max_new_tokens=1).result(timeout_s=60)
        greedy = {"max_new_tokens": 8}
        sampled = {"max_new_tokens": 8, "temperature": 1.0, "top_k": 20, "seed": 5}
        mix = [("a0", greedy), ("bad", sampled), (BASE, sampled), ("bad", greedy),
               ("a2", sampled), ("a3", greedy), ("bad", sampled), (BASE, greedy)]  # fmt: skip
        # While the engine is busy with a first request, the mix queues up behind it.
        with scheduler.engine.lock:
            submit(scheduler, PROMPTS[1], BASE, max_new_tokens=1)
            deadline = time.monotonic() + 30
            while scheduler.queue_depth:  # until the first request has left the queue
                assert time.monotonic() < deadline, "the scheduler did not take the request"
                time.sleep(0.001)
            requests = [
                submit(scheduler, PROMPTS[n], key, **params) for n, (key, params) in enumerate(mix)
            ]
        for n, ((key, params), request) in enumerate(zip(mix, requests, strict=True)):
            if key == "bad":
                with pytest.raises(MintError, match="bad produced non-finite logits"):
                    request.result(timeout_s=30)
                continue
            expected = submit(scheduler, PROMPTS[n], key, **params).result(timeout_s=30)
            assert request.result(timeout_s=30).token_ids == expected.token_ids, key
            if params is greedy:
                assert expected.token_ids == alone(reference, PROMPTS[n], key, 8)
        assert len({r.joined_step for r in requests}) == 1
        settle(scheduler)
        assert [entry.pins for entry in scheduler.residency.slot_table()] == [0] * len(host)


def test_whatever_a_step_raises_every_request_in_it_answers_and_unpins(
    scheduler: Scheduler, reference: TorchEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = scheduler.engine
    step = engine.step

    def prefill_of_a3_breaks(*args: Any) -> Any:
        if args[3] is None and engine.adapters >= {"a3"} and engine.slot_of("a3") in args[2]:
            raise RuntimeError("simulated kernel failure")
        return step(*args)

    monkeypatch.setattr(engine, "step", prefill_of_a3_breaks)
    key, prompt = long_running(reference, keys=("a0", "a1", "a2", "a4", BASE))
    running = submit(scheduler, prompt, key, max_new_tokens=40)
    events = running.events(timeout_s=30)
    assert isinstance(next(events), TokenEvent)  # it is running
    joining = [submit(scheduler, PROMPTS[0], "a3", max_new_tokens=4),
               submit(scheduler, PROMPTS[1], "a3", temperature=1.0, max_new_tokens=4)]  # fmt: skip
    for request in joining:
        with pytest.raises(MintError, match="simulated kernel failure"):
            request.result(timeout_s=30)
    with pytest.raises(MintError, match="simulated kernel failure"):
        list(events)
    settle(scheduler)
    assert all(entry.pins == 0 for entry in scheduler.residency.slot_table())
    # The scheduler goes on serving.
    monkeypatch.setattr(engine, "step", step)
    answer = submit(scheduler, PROMPTS[0], "a3", max_new_tokens=4).result(timeout_s=30)
    assert answer.token_ids == alone(reference, PROMPTS[0], "a3", 4)


def test_a_slot_copy_for_a_users_request_counts_as_a_request_path_load(
    adapters: dict[str, AdapterWeights], reference: TorchEngine, home: Path
) -> None:
    for scheduler in scheduler_for(adapters, home, slots=1):
        warm_up = scheduler.submit([1, 2, 3], "a0", SamplingParams(max_new_tokens=1), warm_up=True)
        warm_up.result(timeout_s=60)
        assert (scheduler.residency.slot_table()[0].key, scheduler.request_path_loads) == ("a0", 0)
        # a0 is in the slot: a hit. a1 must be copied in, then a0 again: two loads.
        for key, loads in [("a0", 0), ("a1", 1), ("a1", 1), ("a0", 2), (BASE, 2)]:
            answer = submit(scheduler, PROMPTS[0], key, max_new_tokens=3).result(timeout_s=60)
            assert answer.token_ids == alone(reference, PROMPTS[0], key, 3)
            assert scheduler.request_path_loads == loads, key


def test_waiting_requests_join_in_fair_share_order_not_arrival_order(
    adapters: dict[str, AdapterWeights], home: Path
) -> None:
    engine = TorchEngine(tiny_base(SPEC, home), slots=1)
    residency: Residency[AdapterWeights] = Residency(1 << 30, device_slots=1)
    scheduler = Scheduler(engine, residency, WorkerMetrics(residency), max_batch=1)
    try:
        # Never ends at an end id: each runs its max_new_tokens, one at a time (max_batch 1).
        params = SamplingParams(max_new_tokens=8, stop_token_ids=[])
        ids = engine.codec.encode(PROMPTS[0])
        blocker = scheduler.submit(ids, BASE, SamplingParams(max_new_tokens=100, stop_token_ids=[]))
        while blocker.joined_step is None:
            time.sleep(0.001)
        sent = {}
        for name, principal in [("a1", "loud"), ("a2", "loud"), ("a3", "loud"), ("a4", "loud"),
                                ("b1", "quiet"), ("b2", "quiet")]:  # fmt: skip
            sent[name] = scheduler.submit(ids, BASE, params, principal=principal)
        assert blocker.joined_step is not None and blocker.left_step is None, "queued too late"
        for request in sent.values():
            request.result()
        order = sorted(sent, key=lambda name: sent[name].joined_step or 0)
        assert order == ["a1", "b1", "a2", "b2", "a3", "a4"]  # tenancy's table, on the engine
    finally:
        scheduler.stop()
