"""R3 end to end on a tiny Qwen3-MoE: the embedded engine's scheduler samples completions with
their per-token log-probabilities and routes, and a trainer (a plain Hugging Face forward of
prompt + completion[:-1]) that replays those routes scores the same log-probabilities; after a
router step the trainer's own routing flips and replay undoes it. Then the same through the
worker's HTTP API (`WorkerClient.sample`), and the refusals (dense base, vLLM).

The base's routers are set near-tied (std 1e-3, experts 1 and 2 scoring every token alike) and
its experts large (std 0.3), so that one small router step flips routes and a flipped token's
log-probability moves. Replay's own gap grows with the step (the gate weights are recomputed
from the moved router), so the step is small: at lr 2e-5 it stays at the engine's float
rounding here.
"""

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from transformers import PreTrainedModel

from mint_core.artifacts.stores import open_store
from mint_core.catalog.catalog import Catalog
from mint_core.config import MintConfig
from mint_core.errors import ConfigurationError
from mint_core.model.base import BaseModel
from mint_core.model.generate import Generation, Route, seeded
from mint_core.model.routing import flip_rate, moe_gates, recording_routes, replaying_routes
from mint_core.model.tiny import TinySpec
from mint_core.model.toy import held_out_words, prompt_for
from mint_core.planning.residency import Residency
from mint_core.registry import Registry
from processes import ManagedProcess
from serving.backends.embedded import EmbeddedBackend
from serving.backends.vllm import VllmBackend
from serving.engine.engine import BASE, AdapterWeights, TorchEngine
from serving.engine.sampling import SamplingParams
from serving.engine.scheduler import Scheduler
from serving.http.app import create_app
from serving.http.client import WorkerClient
from serving.metrics import WorkerMetrics
from serving.worker.worker import Worker
from tests.helpers import ENGINE_SPEC, tiny_base

MOE_SPEC = TinySpec(
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    intermediate_size=32,
    num_experts=4,
    experts_per_token=2,
    pretrain_steps=0,
)
PROMPTS = [prompt_for(word) for word in held_out_words(8)]
SAMPLES = 4
"""Completions per prompt, as GRPO samples a group."""
NEW_TOKENS = 12
ATOL = 1e-4
ROUTER_LR = 2e-5


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("r3")


@pytest.fixture(scope="module")
def base(home: Path) -> BaseModel:
    base = tiny_base(MOE_SPEC, home)
    with seeded(0), torch.no_grad():
        for name, parameter in base.model.named_parameters():
            if ".experts." in name:
                parameter.normal_(std=0.3)
        for gate in moe_gates(base.model):
            gate.module.weight.normal_(std=1e-3)
            gate.module.weight[1] = gate.module.weight[2]
    return base


@pytest.fixture(scope="module")
def trainer_base(base: BaseModel) -> PreTrainedModel:
    """The base as a trainer holds it: an unwrapped copy, taken before the engine wraps it."""
    return copy.deepcopy(base.model)


@pytest.fixture(scope="module")
def engine(base: BaseModel, trainer_base: PreTrainedModel) -> TorchEngine:
    return TorchEngine(base, slots=1)


@pytest.fixture(scope="module")
def scheduler(engine: TorchEngine) -> Iterator[Scheduler]:
    residency: Residency[AdapterWeights] = Residency(1 << 20, device_slots=1)
    scheduler = Scheduler(engine, residency, WorkerMetrics(residency))
    yield scheduler
    scheduler.stop()


def sampled(scheduler: Scheduler) -> list[tuple[list[int], Generation]]:
    """SAMPLES completions of each prompt at temperature 1, all submitted at once: prompts of
    different lengths share a left-padded prefill and then decode together."""
    codec = scheduler.engine.codec
    requests = []
    for p, prompt in enumerate(PROMPTS):
        ids = codec.encode(prompt)
        for s in range(SAMPLES):
            params = SamplingParams(
                max_new_tokens=NEW_TOKENS, temperature=1.0, seed=100 * p + s, return_routes=True
            )
            requests.append((ids, scheduler.submit(ids, BASE, params)))
    return [(ids, request.result(timeout_s=60)) for ids, request in requests]


def scored(
    model: PreTrainedModel, prompt_ids: list[int], token_ids: tuple[int, ...]
) -> torch.Tensor:
    """Each sampled token's log-probability from one forward of prompt + tokens[:-1]."""
    ids = torch.tensor([[*prompt_ids, *token_ids[:-1]]])
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 :].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(token_ids)[:, None])[:, 0]


def route_table(prompt_routes: tuple[Route, ...], routes: tuple[Route, ...]) -> torch.Tensor:
    """`[1, positions, layers, top_k]`: what `replaying_routes` takes for one sequence."""
    return torch.tensor([[*prompt_routes, *routes]])


def check_shapes(prompt_ids: list[int], tokens: int, prompt_routes: object, routes: object) -> None:
    layers, top_k = MOE_SPEC.num_layers, MOE_SPEC.experts_per_token
    assert prompt_routes is not None and routes is not None
    assert torch.tensor(prompt_routes).shape == (len(prompt_ids) - 1, layers, top_k)
    assert torch.tensor(routes).shape == (tokens, layers, top_k)


def gaps(
    model: PreTrainedModel, samples: list[tuple[list[int], Generation]]
) -> tuple[float, float, float]:
    """The flip rate of `model`'s own routing against the sampler's, and the largest
    log-probability gap to the sampler's without and with replay."""
    free_gap = replay_gap = 0.0
    own, theirs = [], []
    with torch.no_grad():
        for prompt_ids, generation in samples:
            assert generation.routes is not None and generation.prompt_routes is not None
            table = route_table(generation.prompt_routes, generation.routes)
            sampler = torch.tensor(generation.logprobs)
            with recording_routes(model) as recorded:
                free = scored(model, prompt_ids, generation.token_ids)
            with replaying_routes(model, table):
                replayed = scored(model, prompt_ids, generation.token_ids)
            own.append(recorded.indices[0])
            theirs.append(table[0])
            free_gap = max(free_gap, (free - sampler).abs().max().item())
            replay_gap = max(replay_gap, (replayed - sampler).abs().max().item())
    return flip_rate(torch.cat(theirs), torch.cat(own)), free_gap, replay_gap


def router_step(model: PreTrainedModel, samples: list[tuple[list[int], Generation]]) -> None:
    """One SGD step on the routers alone, raising the sampled tokens' log-probabilities (what
    a policy-gradient step with positive advantages does to them)."""
    routers = [gate.module.weight for gate in moe_gates(model)]
    model.requires_grad_(False)
    for weight in routers:
        weight.requires_grad_(True)
    optimizer = torch.optim.SGD(routers, lr=ROUTER_LR)
    loss = -torch.cat([scored(model, ids, g.token_ids) for ids, g in samples]).mean()
    loss.backward()
    optimizer.step()
    model.requires_grad_(False)


def test_replayed_routes_reproduce_the_samplers_logprobs_and_undo_a_router_step(
    scheduler: Scheduler, trainer_base: PreTrainedModel
) -> None:
    samples = sampled(scheduler)
    for prompt_ids, generation in samples:
        check_shapes(prompt_ids, len(generation.token_ids), generation.prompt_routes,
                     generation.routes)  # fmt: skip
    tokens = sum(len(g.token_ids) for _, g in samples)
    trainer = copy.deepcopy(trainer_base)

    flips, free_gap, replay_gap = gaps(trainer, samples)
    same = figures("same weights", flips, free_gap, replay_gap)
    print(f"{len(samples)} samples, {tokens} tokens; {same}")
    assert replay_gap <= ATOL, same

    router_step(trainer, samples)
    flips, free_gap, replay_gap = gaps(trainer, samples)
    stepped = figures(f"after a router step (SGD lr {ROUTER_LR})", flips, free_gap, replay_gap)
    print(stepped)
    assert flips > 0, stepped
    assert free_gap > ATOL, stepped
    assert replay_gap <= ATOL, stepped


def figures(when: str, flips: float, free_gap: float, replay_gap: float) -> str:
    return (
        f"{when}: flip rate {flips:.4f}, log-prob gap without replay {free_gap:.3g}, "
        f"with replay {replay_gap:.3g}"
    )


def test_routes_are_refused_where_they_cannot_be_recorded(home: Path) -> None:
    residency: Residency[AdapterWeights] = Residency(1 << 20, device_slots=1)
    dense = Scheduler(TorchEngine(tiny_base(ENGINE_SPEC, home), slots=1), residency,
                      WorkerMetrics(residency))  # fmt: skip
    try:
        with pytest.raises(ConfigurationError, match="LlamaForCausalLM has no MoE router"):
            dense.submit([1, 2, 3], BASE, SamplingParams(return_routes=True))
        # Without routes the dense base serves as ever.
        assert dense.submit([1, 2, 3], BASE, SamplingParams(max_new_tokens=2)).result(30)
    finally:
        dense.stop()
    vllm = object.__new__(VllmBackend)  # its refusal comes before any server is needed
    with pytest.raises(ConfigurationError, match="not on vllm"):
        vllm.submit([1, 2, 3], BASE, SamplingParams(return_routes=True))


def test_worker_client_samples_with_routes_over_http(
    base: BaseModel,
    engine: TorchEngine,
    trainer_base: PreTrainedModel,
    home: Path,
    mlflow_server: ManagedProcess,
) -> None:
    config = MintConfig(home=home, tracking_uri=mlflow_server.url)
    backend = EmbeddedBackend(engine, config.host_cache_mb << 20)
    worker = Worker(backend, Catalog(Registry(config.tracking_uri)), open_store(config),
                    sync_interval_s=3600).start()  # fmt: skip
    try:
        with TestClient(create_app(worker)) as http:
            client = WorkerClient("http://testserver", http=http)
            samples = client.sample(PROMPTS[0], None, n=SAMPLES, max_new_tokens=NEW_TOKENS, seed=7)
            plain = client.sample(PROMPTS[0], None, n=1, max_new_tokens=4, routes=False)
    finally:
        worker.close()
    prompt_ids = base.codec.encode(PROMPTS[0])
    assert {s.revision for s in samples} == {base.model_id}
    assert len({s.token_ids for s in samples}) > 1, "seeds 7..10 drew the same completion"
    with torch.no_grad():
        for sample in samples:
            check_shapes(prompt_ids, len(sample.token_ids), sample.prompt_routes, sample.routes)
            assert sample.prompt_routes is not None and sample.routes is not None
            with replaying_routes(trainer_base, route_table(sample.prompt_routes, sample.routes)):
                replayed = scored(trainer_base, prompt_ids, sample.token_ids)
            torch.testing.assert_close(replayed, torch.tensor(sample.logprobs), atol=ATOL, rtol=0)
    assert plain[0].routes is None and plain[0].prompt_routes is None
