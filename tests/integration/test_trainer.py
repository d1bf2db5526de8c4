"""`mint trainer` against the real `tinker` SDK (0.38): every route the SDK calls, a supervised
loop that learns, its sampler revision served by a worker exactly as the sampling client
answered, two tenants at once getting what each gets alone, bad requests failing only their
own future, the RL losses' formulas (CISPO's and DRO's gradients too), and training state
surviving a restart."""

import dataclasses
import os
import threading
from collections.abc import Iterator
from contextlib import nullcontext

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from mint_core.config import MintConfig
from mint_core.model.base import BaseModel
from mint_core.model.toy import Task, held_out_words, prompt_for, training_stream
from mint_core.registry import Registry
from mint_core.revisions import PRODUCTION
from processes import ManagedProcess
from tasks.pipeline import admit_revision
from tests.integration.helpers import activate
from trainer.server import start_trainer

pytestmark = pytest.mark.slow

KEYS = {"tml-team-a": "team-a", "tml-team-b": "team-b", "tml-admin": "admin"}
"""The trainer's API keys: the same principals as the session worker's keys name (`admin` is
the default `MINT_ADMIN_PRINCIPALS`)."""
STEPS = 300
LEARNING_RATE = 4e-3
"""Peak learning rate, decayed linearly to 0 over the steps, gradients clipped to norm 1:
held-out exact 0.98, 0.98, 1.0 over LoRA seeds 0-2 (300 steps, rank 8, `upper`)."""
BATCH = 32


@pytest.fixture(scope="module")
def trainer_config(config: MintConfig) -> MintConfig:
    return dataclasses.replace(config, api_keys=KEYS)


@pytest.fixture(scope="module")
def trainer(trainer_config: MintConfig) -> Iterator[ManagedProcess]:
    os.environ["TINKER_TELEMETRY"] = "1"  # the SDK sends its telemetry: a route to exercise
    process = start_trainer(trainer_config)
    yield process
    process.stop()


def service(
    trainer: ManagedProcess, key: str = "tml-team-a", user_metadata: dict[str, str] | None = None
) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=trainer.url, api_key=key, user_metadata=user_metadata)


class Toy:
    """Datums of the toy tasks, tokenized by the tokenizer the trainer names."""

    def __init__(self, tokenizer: object) -> None:
        self.tok = tokenizer

    def ids(self, prompt: str) -> list[int]:
        return list(self.tok(prompt, add_special_tokens=True)["input_ids"])  # type: ignore[operator]

    def datum(self, prompt: str, answer: str) -> types.Datum:
        p = self.ids(prompt)
        a = [*self.tok(answer, add_special_tokens=False)["input_ids"], self.tok.eos_token_id]  # type: ignore[operator,attr-defined]
        full = p + a
        weights = [0.0] * (len(p) - 1) + [1.0] * len(a)
        return types.Datum(
            model_input=types.ModelInput.from_ints(full[:-1]),
            loss_fn_inputs={"target_tokens": full[1:], "weights": weights},
        )

    def batches(self, task: Task, seed: int) -> Iterator[list[types.Datum]]:
        stream = training_stream(task, seed)
        while True:
            yield [self.datum(e.prompt, e.completion) for e in (next(stream) for _ in range(BATCH))]


def train(
    client: tinker.TrainingClient, batches: Iterator[list[types.Datum]], steps: int
) -> list[float]:
    """`steps` supervised steps; each step's loss (sum over the batch)."""
    losses = []
    for step in range(steps):
        fb = client.forward_backward(next(batches), "cross_entropy")
        rate = LEARNING_RATE * (1 - step / steps)
        optim = client.optim_step(types.AdamParams(learning_rate=rate, grad_clip_norm=1.0))
        losses.append(fb.result().metrics["loss:sum"])
        optim.result()
    return losses


def greedy(
    sampler: tinker.SamplingClient, toy: Toy, words: list[str]
) -> list[types.SampledSequence]:
    params = types.SamplingParams(max_tokens=12, temperature=0.0)
    futures = [
        sampler.sample(types.ModelInput.from_ints(toy.ids(prompt_for(w))), 1, params) for w in words
    ]
    return [f.result().sequences[0] for f in futures]


def exact(toy: Toy, task: Task, words: list[str], sequences: list[types.SampledSequence]) -> float:
    hits = 0
    for word, sequence in zip(words, sequences, strict=True):
        text = toy.tok.decode([t for t in sequence.tokens if t != toy.tok.eos_token_id])  # type: ignore[attr-defined]
        hits += sequence.stop_reason == "stop" and text == task.answer(word)
    return hits / len(words)


def test_a_supervised_loop_learns_and_its_revision_answers_through_a_worker_as_its_sampler(
    trainer: ManagedProcess, trainer_config: MintConfig, worker: ManagedProcess, base: BaseModel
) -> None:
    with service(trainer) as sc:
        client = sc.create_lora_training_client(
            base_model=str(base.text.path),
            rank=8,
            seed=0,
            user_metadata={"mint_adapter": "tinker-upper"},
        ).result()
        info = client.get_info()
        assert info.model_data.tokenizer_id == str(base.text.path) and info.lora_rank == 8
        toy = Toy(client.get_tokenizer())
        losses = train(client, toy.batches(Task.UPPER, 0), STEPS)
        assert losses[-1] < losses[0] / 10

        words = held_out_words(64)
        ephemeral = client.save_weights_and_get_sampling_client().result()
        assert exact(toy, Task.UPPER, words, greedy(ephemeral, toy, words)) >= 0.8

        # Named sampler weights: a MinT revision, and a sampler of that path.
        path = client.save_weights_for_sampler("final").result().path
        assert path == f"tinker://{client.model_id}/sampler_weights/final"
        sampler = sc.create_sampling_client(model_path=path).result()
        answers = greedy(sampler, toy, words[:8])
        with (
            service(trainer, "tml-team-b") as other,
            pytest.raises(tinker.PermissionDeniedError, match="'team-b' may not use"),
        ):
            other.create_sampling_client(model_path=path).result()

        # The sampler's logprobs are the trainer's for the same weights and tokens.
        prompt = toy.ids(prompt_for(words[0]))
        sampled = sampler.sample(
            types.ModelInput.from_ints(prompt),
            1,
            types.SamplingParams(max_tokens=8, temperature=0.0),
            include_prompt_logprobs=True,
        ).result()
        full = prompt + list(sampled.sequences[0].tokens)
        forward = client.forward(
            [
                types.Datum(
                    model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)},
                )
            ],
            "cross_entropy",
        ).result()
        trained = forward.loss_fn_outputs[0]["logprobs"].to_numpy()
        assert sampled.prompt_logprobs is not None and sampled.prompt_logprobs[0] is None
        served = np.array([*sampled.prompt_logprobs[1:], *sampled.sequences[0].logprobs])
        np.testing.assert_allclose(served, trained, atol=2e-4)

    registry = Registry(trainer_config.tracking_uri)
    registered = registry.revisions.of("tinker-upper")[-1]
    policy = registered.policy
    assert policy.base_digest == base.digest and policy.training_steps == STEPS
    assert policy.dataset.startswith("tinker session ") and policy.principals == ("team-a",)
    fleet = dataclasses.replace(trainer_config, worker_urls=(worker.url,))
    admit_revision(fleet, registered.id)
    activate(fleet, registered.id, PRODUCTION, actor="test")
    for word, answer in zip(words[:8], answers, strict=True):
        response = httpx.post(
            worker.url + "/generate",
            headers={"Authorization": "Bearer key-team-a"},
            json={
                "inputs": prompt_for(word),
                "parameters": {
                    "adapter_id": "tinker-upper@production",
                    "max_new_tokens": 12,
                    "details": True,
                },
            },
        )
        assert response.status_code == 200, response.text
        assert [t["id"] for t in response.json()["details"]["tokens"]] == list(answer.tokens)


def test_two_tenants_at_once_each_get_what_they_get_alone(
    trainer: ManagedProcess, base: BaseModel
) -> None:
    steps = 12
    plans = {"tml-team-a": (Task.UPPER, 1), "tml-team-b": (Task.REVERSE, 2)}

    def run(key: str, results: dict[str, list[float]]) -> None:
        task, seed = plans[key]
        with service(trainer, key) as sc:
            client = sc.create_lora_training_client(
                base_model=str(base.text.path), rank=4, seed=seed
            ).result()
            toy = Toy(client.get_tokenizer())
            results[key] = train(client, toy.batches(task, seed), steps)

    alone: dict[str, list[float]] = {}
    for key in plans:
        run(key, alone)
    together: dict[str, list[float]] = {}
    threads = [threading.Thread(target=run, args=(key, together)) for key in plans]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for key in plans:
        np.testing.assert_allclose(together[key], alone[key], rtol=1e-4)


def test_a_bad_request_fails_its_own_future_with_a_clear_error_and_nothing_else(
    trainer: ManagedProcess, base: BaseModel
) -> None:
    with service(trainer) as sc:
        client = sc.create_lora_training_client(base_model=str(base.text.path), rank=4).result()
        toy = Toy(client.get_tokenizer())
        good = next(toy.batches(Task.UPPER, 3))
        before = client.forward(good, "cross_entropy").result().metrics["loss:sum"]

        with pytest.raises(
            tinker.RequestFailedError, match=r"loss_fn='dpo' is not supported.*cross_entropy"
        ):
            client.forward_backward(good, "dpo").result()
        beyond = types.Datum(
            model_input=types.ModelInput.from_ints([5, 6, 7]),
            loss_fn_inputs={"target_tokens": [6, 7, 100_000], "weights": [1.0, 1.0, 1.0]},
        )
        with pytest.raises(
            tinker.RequestFailedError, match=r"token 100000, outside the base's vocabulary"
        ):
            client.forward_backward([beyond], "cross_entropy").result()
        stranger = tinker.TrainingClient(
            client.holder, model_seq_id=99, model_id="s-nobody:train:0", info=client.get_info()
        )
        with pytest.raises(
            tinker.RequestFailedError, match=r"no training model 's-nobody:train:0'"
        ):
            stranger.forward(good, "cross_entropy").result()
        with pytest.raises(tinker.RequestFailedError) as failed:
            client.forward_backward(good, "dpo").result()
        assert failed.value.category is types.RequestErrorCategory.User

        # Nothing else happened: the model is where it was, and it trains on.
        assert client.forward(good, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(
            before
        )
        path = client.save_state("before").result().path
        assert train(client, iter([good]), 1)[0] == pytest.approx(before)
        assert client.forward(good, "cross_entropy").result().metrics["loss:sum"] < before
        # Back to where it was (the SDK deprecates loading into a live client, but sends it).
        with pytest.warns(FutureWarning, match="load_state"):
            client.load_state_with_optimizer(path).result()
        assert client.forward(good, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(
            before
        )


def weighted(tokens: list[int], weights: np.ndarray) -> types.Datum:
    """`tokens` for `cross_entropy`, whose gradient on their logprobs is `-weights`."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def logprobs_now(client: tinker.TrainingClient, tokens: list[int]) -> np.ndarray:
    """The model's logprobs of `tokens[1:]`, each after the tokens before it."""
    plain = weighted(tokens, np.ones(len(tokens) - 1, dtype=np.float32))
    return (
        client.forward([plain], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    )


@dataclasses.dataclass(frozen=True)
class Rollout:
    """`hello=HELLO` as RL data: the model's own logprobs of it, a sampler's near them, and
    advantages."""

    tokens: list[int]
    logprobs: np.ndarray
    sampling: np.ndarray
    advantages: np.ndarray

    @classmethod
    def of(cls, client: tinker.TrainingClient) -> "Rollout":
        tokens = Toy(client.get_tokenizer()).ids("hello=HELLO")
        logprobs = logprobs_now(client, tokens)
        rng = np.random.default_rng(0)
        sampling = logprobs + rng.uniform(-0.5, 0.5, len(logprobs)).astype(np.float32)
        advantages = rng.normal(size=len(logprobs)).astype(np.float32)
        return cls(tokens, logprobs, sampling, advantages)

    def datum(self) -> types.Datum:
        return types.Datum(
            model_input=types.ModelInput.from_ints(self.tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": self.tokens[1:],
                "logprobs": self.sampling,
                "advantages": self.advantages,
            },
        )


def test_rl_losses_follow_the_sdk_formulas(trainer: ManagedProcess, base: BaseModel) -> None:
    with service(trainer) as sc:
        client = sc.create_lora_training_client(base_model=str(base.text.path), rank=4).result()
        rollout = Rollout.of(client)
        rl = rollout.datum()
        logprobs, sampling, advantages = rollout.logprobs, rollout.sampling, rollout.advantages
        ratio = np.exp(logprobs - sampling)
        importance = client.forward([rl], "importance_sampling").result().metrics["loss:sum"]
        assert importance == pytest.approx(-(ratio * advantages).sum(), rel=1e-4)
        ppo = client.forward(
            [rl], "ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
        ).result()
        clipped = np.minimum(ratio * advantages, np.clip(ratio, 0.9, 1.1) * advantages)
        assert ppo.metrics["loss:sum"] == pytest.approx(-clipped.sum(), rel=1e-4)
        negative = weighted(rollout.tokens, np.full(len(logprobs), -0.5, dtype=np.float32))
        assert client.forward([negative], "cross_entropy").result().metrics[
            "loss:sum"
        ] == pytest.approx(0.5 * logprobs.sum(), rel=1e-4)


def test_cispo_and_dro_follow_the_sdk_formulas_in_value_and_gradient(
    trainer: ManagedProcess, base: BaseModel
) -> None:
    with service(trainer) as sc:
        client = sc.create_lora_training_client(base_model=str(base.text.path), rank=4).result()
        rollout = Rollout.of(client)
        rl = rollout.datum()
        logprobs, sampling, advantages = rollout.logprobs, rollout.sampling, rollout.advantages
        ratio = np.exp(logprobs - sampling)

        def loss(name: str, config: dict[str, float] | None = None) -> float:
            return client.forward([rl], name, config).result().metrics["loss:sum"]

        # CISPO's default thresholds are 0 and 4: within them here, the weight is the ratio.
        assert loss("cispo") == pytest.approx(-(ratio * logprobs * advantages).sum(), rel=1e-4)
        tight = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
        weight = np.clip(ratio, 0.9, 1.1)
        assert loss("cispo", tight) == pytest.approx(
            -(weight * logprobs * advantages).sum(), rel=1e-4
        )
        drift = logprobs - sampling
        assert loss("dro", {"beta": 0.05}) == pytest.approx(
            -(logprobs * advantages - 0.5 * 0.05 * drift**2).sum(), rel=1e-4
        )
        with pytest.raises(tinker.RequestFailedError, match=r"dro' needs loss_fn_config\['beta'\]"):
            client.forward_backward([rl], "dro").result()
        with pytest.raises(tinker.RequestFailedError, match=r"cispo clip_low_threshold=1.5"):
            client.forward_backward([rl], "cispo", {"clip_low_threshold": 1.5}).result()

        # The gradients: each loss's, added to a cross_entropy whose gradient is the hand
        # computation's negative, leaves nothing for the step to move (eps 1 keeps Adam from
        # blowing float noise up to full steps); the loss alone moves it.
        step = types.AdamParams(learning_rate=1.0, eps=1.0)
        for name, config, grad in [
            ("cispo", tight, -weight * advantages),
            ("dro", {"beta": 0.05}, -(advantages - 0.05 * drift)),
        ]:
            client.forward_backward([rl], name, config).result()
            client.forward_backward([weighted(rollout.tokens, grad)], "cross_entropy").result()
            client.optim_step(step).result()
            now = logprobs_now(client, rollout.tokens)
            np.testing.assert_allclose(now, logprobs, atol=1e-5, err_msg=name)
        client.forward_backward([rl], "cispo", tight).result()
        client.optim_step(step).result()
        assert np.abs(logprobs_now(client, rollout.tokens) - logprobs).max() > 1e-2


def test_state_saved_survives_a_restart_and_training_continues_with_the_same_loss(
    trainer_config: MintConfig, base: BaseModel
) -> None:
    first = start_trainer(trainer_config)
    try:
        with service(first) as sc:
            client = sc.create_lora_training_client(
                base_model=str(base.text.path), rank=4, seed=5
            ).result()
            toy = Toy(client.get_tokenizer())
            batches = toy.batches(Task.REVERSE, 5)
            train(client, batches, 5)
            path = client.save_state("step-5").result().path
            following = [next(batches) for _ in range(3)]
            expected = train(client, iter(following), 3)
    finally:
        first.stop()
    second = start_trainer(trainer_config)
    try:
        with service(second) as sc:
            resumed = sc.create_training_client_from_state_with_optimizer(path).result()
            assert train(resumed, iter(following), 3) == pytest.approx(expected, rel=1e-5)
    finally:
        second.stop()


def test_a_training_state_loads_only_for_the_tenant_that_saved_it_and_admins(
    trainer: ManagedProcess, base: BaseModel
) -> None:
    with service(trainer, "tml-team-a") as owner:
        client = owner.create_lora_training_client(
            base_model=str(base.text.path), rank=4, seed=7
        ).result()
        toy = Toy(client.get_tokenizer())
        good = next(toy.batches(Task.UPPER, 7))
        train(client, iter([good]), 1)
        path = client.save_state("private").result().path
        saved = client.forward(good, "cross_entropy").result().metrics["loss:sum"]
        other_path = client.save_state("other").result().path

        with service(trainer, "tml-team-b") as intruder:
            mine = intruder.create_lora_training_client(
                base_model=str(base.text.path), rank=4, seed=8
            ).result()
            before = mine.forward(good, "cross_entropy").result().metrics["loss:sum"]
            loads = {
                "create_training_client_from_state": lambda: (
                    intruder.create_training_client_from_state(path).result()
                ),
                "create_training_client_from_state_with_optimizer": lambda: (
                    intruder.create_training_client_from_state_with_optimizer(path).result()
                ),
                "load_state": lambda: mine.load_state(path).result(),
                "load_state_with_optimizer": lambda: mine.load_state_with_optimizer(path).result(),
            }
            for call, load in loads.items():
                with (
                    pytest.warns(FutureWarning) if call.startswith("load_state") else nullcontext(),
                    pytest.raises(tinker.RequestFailedError) as refused,
                ):
                    load()
                # Refused as a sampler path is, naming only the path asked for: not its owner,
                # not what it holds, not the owner's other paths.
                said = f"Request failed: principal 'team-b' may not load {path} for "
                assert refused.value.message.startswith(said), (call, refused.value.message)
                assert refused.value.category is types.RequestErrorCategory.User, call
                assert "team-a" not in refused.value.message and other_path not in str(refused)
            # The intruder's own model is untouched.
            after = mine.forward(good, "cross_entropy").result().metrics["loss:sum"]
            assert after == pytest.approx(before)

        # Its owner and an admin still load it.
        resumed = owner.create_training_client_from_state_with_optimizer(path).result()
        assert resumed.forward(good, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(
            saved
        )
        with pytest.warns(FutureWarning):
            client.load_state(path).result()
    with service(trainer, "tml-admin") as admin:
        held = admin.create_training_client_from_state(path).result()
        assert held.forward(good, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(
            saved
        )


def test_mint_adapter_names_the_revision_wherever_the_sdk_sends_it(
    trainer: ManagedProcess, trainer_config: MintConfig
) -> None:
    # What a Tinker user does before any training client exists: ask the server for its base.
    capabilities = tinker.RestClient(base_url=trainer.url, api_key="tml-team-a")
    base_name = capabilities.get_server_capabilities().result().supported_models[0].model_name
    assert base_name is not None
    registry = Registry(trainer_config.tracking_uri)

    def shipped(adapter: str) -> list[str]:
        return [r.policy.dataset for r in registry.revisions.of(adapter)]

    with service(trainer) as sc:
        client = sc.create_lora_training_client(base_model=base_name, rank=4, seed=9).result()
        client.save_weights_for_sampler(
            "named", user_metadata={"mint_adapter": "tk-sampler-named"}
        ).result()
        state = client.save_state("named-state").result().path
        resumed = sc.create_training_client_from_state(
            state, user_metadata={"mint_adapter": "tk-from-state"}
        ).result()
        resumed.save_weights_for_sampler("resumed").result()
        with_optimizer = sc.create_training_client_from_state_with_optimizer(
            state, user_metadata={"mint_adapter": "tk-from-state-optimizer"}
        ).result()
        with_optimizer.save_weights_for_sampler("resumed").result()
        # A name the registry would refuse fails the request that gives it, not a later save.
        with pytest.raises(tinker.RequestFailedError, match="adapter name 'Not A Name'"):
            client.save_weights_for_sampler(
                "bad", user_metadata={"mint_adapter": "Not A Name"}
            ).result()
    lineage = f"tinker session {client.model_id.split(':')[0]}"
    assert shipped("tk-sampler-named") == [lineage]
    assert shipped("tk-from-state") == [lineage]
    assert shipped("tk-from-state-optimizer") == [lineage]
    with service(trainer, "tml-team-a", user_metadata={"mint_adapter": "tk-session"}) as named:
        client = named.create_lora_training_client(base_model=base_name, rank=4).result()
        client.save_weights_for_sampler("from-session").result()
    assert len(shipped("tk-session")) == 1
    # Another tenant may not add revisions to team-a's adapter by naming it.
    with service(trainer, "tml-team-b", user_metadata={"mint_adapter": "tk-session"}) as other:
        client = other.create_lora_training_client(base_model=base_name, rank=4).result()
        refusal = "principal 'team-b' may not add revisions to adapter 'tk-session'"
        with pytest.raises(tinker.RequestFailedError, match=refusal) as refused:
            client.save_weights_for_sampler("into-team-a").result()
        assert refused.value.category is types.RequestErrorCategory.User
    assert len(shipped("tk-session")) == 1


def test_every_route_the_sdk_calls_was_exercised(trainer: ManagedProcess) -> None:
    """Runs last in this module: the routes the tests above drove through the SDK."""
    calls = httpx.get(trainer.url + "/health").json()["calls"]
    routes = {
        "client/config", "client/dynamic_config", "create_session", "session_heartbeat",
        "telemetry", "create_model", "get_info", "forward_backward", "optim_step",
        "save_weights", "load_weights",
        "save_weights_for_sampler", "create_sampling_session", "samplers/{sampler_id}",
        "asample", "retrieve_future", "sessions/{session_id}/finish",
    }  # fmt: skip
    assert routes - calls.keys() == set(), calls
