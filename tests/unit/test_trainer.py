"""`mint trainer`'s parts without a process: request ordering, a round's share of a pass by
weight, the losses' formulas, the SDK's protobuf messages both ways, and the tenants' LoRAs:
what PEFT computes with the same weights, and each tenant's loss and gradient in a shared pass
equal to what it gets alone."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from mint_core.artifacts.stores import LocalArtifactStore
from mint_core.errors import AccessDeniedError, ConfigurationError
from mint_core.model.base import BaseModel, BaseSource, load_base
from tests.helpers import family_folder
from trainer.checkpoints import (
    WEIGHTS,
    CheckpointPath,
    State,
    check_loader,
    load_state,
    save_state,
)
from trainer.compute import Work, check_request, plan_passes, run_pass
from trainer.lora import ALPHA, Layers, Router, Segment, Targets, TenantLora, wrap
from trainer.losses import loss_named, token_logprobs
from trainer.sequencing import GAP_S, Op, OpKind, Sequencer, round_share
from trainer.wire import forward_backward_output, read_forward_backward


def op(seq: int, arrived: float = 0.0) -> Op:
    return Op(seq, OpKind.FORWARD, f"r{seq}", None, arrived)


def test_requests_run_in_seq_id_order_whatever_order_they_arrive_in() -> None:
    queue = Sequencer()
    for seq in (2, 3):
        queue.add(op(seq))
    assert queue.ready(now=1.0) == []  # 1 has not arrived: the chunks wait for it
    queue.add(op(1))
    assert [o.seq_id for o in queue.ready(now=1.0)] == [1, 2, 3]
    queue.take(queue.ready(now=1.0))
    queue.add(op(5, arrived=10.0))
    assert queue.ready(now=10.0 + GAP_S / 2) == []
    assert [o.seq_id for o in queue.ready(now=10.0 + GAP_S + 1)] == [5]  # 4 never came
    queue.take(queue.ready(now=10.0 + GAP_S + 1))
    queue.add(op(1))  # a new client of the same model numbers from 1 again
    assert [o.seq_id for o in queue.ready(now=100.0)] == [1]


def test_the_losses_follow_the_sdk_documentation() -> None:
    logprobs = torch.tensor([-0.5, -1.0, -2.0])
    weights = torch.tensor([1.0, -0.5, 0.0])
    ce = loss_named("cross_entropy").fn(logprobs, {"weights": weights}, {})
    assert float(ce.elementwise.sum()) == pytest.approx(0.5 - 0.5)
    sampling = torch.tensor([-0.4, -1.5, -1.0])
    advantages = torch.tensor([1.0, -2.0, 0.5])
    ratio = torch.exp(logprobs - sampling)
    inputs = {"logprobs": sampling, "advantages": advantages}
    importance = loss_named("importance_sampling").fn(logprobs, inputs, {})
    assert float(importance.elementwise.sum()) == pytest.approx(float(-(ratio * advantages).sum()))
    ppo = loss_named("ppo").fn(logprobs, inputs, {})
    clipped = torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
    assert float(ppo.elementwise.sum()) == pytest.approx(float(-clipped.sum()))
    with pytest.raises(ConfigurationError, match=r"loss_fn='dpo' is not supported.*cispo, dro"):
        loss_named("dpo")


ROOT_E = math.exp(0.5)
"""The ratios of the hand computations below are exp(logprobs - sampling): 1/ROOT_E, ROOT_E and
e^2 (above CISPO's default cap of 4)."""


@pytest.mark.parametrize(
    ("name", "config", "loss", "grad"),
    [
        # the weight is the ratio, e^2 capped at 4: -sum(w * logprobs * advantages), -w * advantages
        ("cispo", {}, -(-0.5 / ROOT_E + 2 * ROOT_E - 4.0), [-1 / ROOT_E, 2 * ROOT_E, -2.0]),
        ("cispo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, -0.8, [-0.8, 2.4, -0.6]),
        # drift (-0.5, 0.5, 2): -(0.5 - beta/2 * 4.5), -(advantages - beta * drift)
        ("dro", {"beta": 0.1}, -0.275, [-1.05, 2.05, -0.3]),
        ("dro", {"beta": 0.0}, -0.5, [-1.0, 2.0, -0.5]),
    ],
)
def test_cispo_and_dro_give_the_value_and_gradient_of_a_hand_computation(
    name: str, config: dict[str, float], loss: float, grad: list[float]
) -> None:
    logprobs = torch.tensor([-0.5, -1.0, -2.0], requires_grad=True)
    inputs = {
        "logprobs": torch.tensor([0.0, -1.5, -4.0]),
        "advantages": torch.tensor([1.0, -2.0, 0.5]),
    }
    loss_named(name).check_config(config)
    result = loss_named(name).fn(logprobs, inputs, config)
    total = result.elementwise.sum()
    total.backward()
    assert float(total.detach()) == pytest.approx(loss)
    assert logprobs.grad is not None
    assert logprobs.grad.tolist() == pytest.approx(grad)
    assert result.outputs["logprobs"].tolist() == pytest.approx([-0.5, -1.0, -2.0])


@pytest.mark.parametrize(
    ("name", "config", "message"),
    [
        (
            "cispo",
            {"clip_low_threshold": 1.5},
            r"cispo clip_low_threshold=1.5, clip_high_threshold=4.0: need 0 <= low <= 1 <= high "
            r"\(e.g. its defaults, 0.0 and 4.0\)",
        ),
        (
            "cispo",
            {"clip_high_threshold": 0.5},
            r"cispo clip_low_threshold=0.0, clip_high_threshold=0.5: need",
        ),
        ("cispo", {"clip_high_threshold": "wide"}, r"clip_high_threshold='wide' must be a number"),
        ("dro", {}, r"loss_fn 'dro' needs loss_fn_config\['beta'\].*example is 0.05"),
        ("dro", {"beta": -0.1}, r"dro beta=-0.1: need a finite number >= 0 \(e.g. 0.05\)"),
        ("dro", {"beta": float("nan")}, r"dro beta=nan: need a finite number >= 0"),
        ("dro", {"beta": "small"}, r"loss_fn_config beta='small' must be a number"),
    ],
)
def test_a_cispo_or_dro_config_it_cannot_run_with_is_refused_naming_the_value(
    name: str, config: dict[str, float | str], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        loss_named(name).check_config(config)


def fb(model_id: str, data: list[types.Datum], loss: str = "cross_entropy") -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss),  # type: ignore[arg-type]
        model_id=model_id,
        seq_id=1,
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def test_the_sdk_protobuf_messages_read_and_written() -> None:
    message = read_forward_backward(fb("m", [datum([1, 5, 6, 7]), datum([1, 8])]), None)
    assert message.model_id == "m" and message.seq_id == 1 and message.loss_fn == "cross_entropy"
    assert [d.tokens.tolist() for d in message.data] == [[1, 5, 6], [1]]
    assert message.data[0].inputs["target_tokens"].tolist() == [5, 6, 7]
    outputs = [
        {"logprobs": np.array([-1.0, -2.0], np.float32)},
        {"logprobs": np.array([-3.0], np.float32)},
    ]
    decoded = deserialize_forward_backward_output(
        forward_backward_output(outputs, {"loss:sum": 6.0})
    )
    assert decoded.metrics == {"loss:sum": 6.0}
    assert [o["logprobs"].tolist() for o in decoded.loss_fn_outputs] == [[-1.0, -2.0], [-3.0]]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> BaseModel:
    home = tmp_path_factory.mktemp("trainer-home")
    return load_base(BaseSource(str(family_folder("llama", home))), home)


@pytest.fixture(scope="module")
def routed(base: BaseModel) -> tuple[BaseModel, Layers, Router]:
    """The base with the trainer's wrappers (a copy of the base: `base` stays plain)."""
    wrapped = load_base(BaseSource(str(base.text.path)), base.text.path.parent.parent)
    layers = Layers.of(wrapped.model)
    router = Router()
    wrap(wrapped.model, layers.shapes, router)
    return wrapped, layers, router


def tenant(layers: Layers, seed: int, targets: Targets | None = None) -> TenantLora:
    names = (targets or Targets()).select(layers)
    lora = TenantLora(
        {n: layers.shapes[n] for n in names}, rank=4, seed=seed, device=torch.device("cpu")
    )
    with torch.no_grad():
        for b in lora.B:
            b.normal_(std=0.05, generator=torch.Generator().manual_seed(seed))
    return lora


def work(base: BaseModel, lora: TenantLora, rows: list[list[int]]) -> Work:
    message = read_forward_backward(fb("m", [datum(r) for r in rows]), None)
    check_request(message, base.model.get_input_embeddings().num_embeddings, base.context_length)
    return Work(message, lora)


ROWS = [[1, 10, 11, 12, 13, 14], [1, 20, 21], [1, 30, 31, 32, 33]]


def test_a_tenant_lora_computes_what_peft_computes_with_its_weights(
    base: BaseModel, routed: tuple[BaseModel, Layers, Router]
) -> None:
    wrapped, layers, router = routed
    lora = tenant(layers, seed=1, targets=Targets(attn=True, mlp=False, unembed=True))
    config, tensors = lora.peft_state(str(base.text.path))
    assert config["target_modules"] == ["k_proj", "lm_head", "o_proj", "q_proj", "v_proj"]
    peft = get_peft_model(
        load_base(BaseSource(str(base.text.path)), base.text.path.parent.parent).model,
        LoraConfig(r=4, lora_alpha=ALPHA, target_modules=config["target_modules"]),  # type: ignore[arg-type]
    )
    loaded = set_peft_model_state_dict(peft, tensors)
    assert not loaded.unexpected_keys
    ids = torch.tensor([ROWS[0]])
    expected = peft(input_ids=ids).logits
    with torch.no_grad(), router.rows((Segment(0, 1, lora),)):
        got = wrapped.model(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_tenants_in_one_pass_get_the_loss_and_gradient_each_gets_alone(
    base: BaseModel, routed: tuple[BaseModel, Layers, Router]
) -> None:
    wrapped, layers, router = routed
    a, b = tenant(layers, seed=2), tenant(layers, seed=3, targets=Targets(mlp=False))

    def run(works: list[Work], tokens: int) -> None:
        for rows in plan_passes(works, tokens):
            run_pass(wrapped.model, router, rows, 0, torch.device("cpu"))

    alone = {}
    for name, lora, rows in (("a", a, ROWS[:2]), ("b", b, ROWS[1:])):
        w = work(base, lora, rows)
        run([w], 10_000)
        alone[name] = (w.loss, [p.grad.clone() for p in lora.parameters()])
        lora.zero_grad(set_to_none=True)
    # Small passes (a request split over several, both tenants in one), and one pass for all
    # (as many rows each: one batched matmul pair per layer both adapt).
    for tokens in (12, 10_000):
        together = [work(base, a, ROWS[:2]), work(base, b, ROWS[1:])]
        run(together, tokens)
        for w, name, lora in ((together[0], "a", a), (together[1], "b", b)):
            assert w.loss == pytest.approx(alone[name][0], rel=1e-5)
            grads = [p.grad for p in lora.parameters()]
            for grad, expected in zip(grads, alone[name][1], strict=True):
                torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6)
            lora.zero_grad(set_to_none=True)
    logprobs = token_logprobs(torch.zeros(2, 5), torch.tensor([1, 2]))
    assert logprobs.tolist() == pytest.approx([-np.log(5)] * 2)


def test_a_bad_request_is_refused_naming_what_is_wrong(base: BaseModel, tmp_path: Path) -> None:
    vocab = base.model.get_input_embeddings().num_embeddings
    beyond = read_forward_backward(fb("m", [datum([1, 2, vocab + 5])]), None)
    with pytest.raises(
        ConfigurationError, match=rf"token {vocab + 5}, outside the base's vocabulary"
    ):
        check_request(beyond, vocab, base.context_length)
    unknown = read_forward_backward(fb("m", [datum([1, 2, 3])], loss="dpo"), None)
    with pytest.raises(
        ConfigurationError, match="use one of cross_entropy, importance_sampling, ppo, cispo, dro"
    ):
        check_request(unknown, vocab, base.context_length)
    with pytest.raises(
        ConfigurationError, match="train_attn, train_mlp and train_unembed are all false"
    ):
        Targets(False, False, False).select(Layers.of(base.model))


def _state(owner: str | None) -> State:
    tensors = {"a": torch.zeros(2, 2)}
    return State({"r": 2}, tensors, None, "sha256:base", 3, ("layer",), owner)


@pytest.mark.parametrize(
    ("owner", "principal", "keyed", "loads"),
    [
        ("team-a", "team-a", True, True),
        ("team-a", "admin", True, True),
        ("team-a", "team-b", True, False),
        ("team-a", "anonymous", False, False),  # keys turned off later: still not its state
        (None, "admin", True, True),
        (None, "team-a", True, False),  # saved before owners were recorded: admins only
        (None, "anonymous", False, True),  # no keys, one tenant: it can only have been its own
    ],
)
def test_a_training_state_loads_for_the_principal_that_saved_it_and_admins(
    tmp_path: Path, owner: str | None, principal: str, keyed: bool, loads: bool
) -> None:
    store = LocalArtifactStore(tmp_path)
    path = CheckpointPath("s-abc:train:0", WEIGHTS, "step-3")
    save_state(store, path, _state(owner))
    state = load_state(store, path)
    assert state.owner == owner
    if loads:
        check_loader(state, path, principal, ("admin",), keyed)
        return
    with pytest.raises(AccessDeniedError) as refused:
        check_loader(state, path, principal, ("admin",), keyed)
    message = str(refused.value)
    assert message.startswith(f"principal {principal!r} may not load {path}")
    assert "team-a" not in message or principal == "team-a"


def test_a_state_saved_before_owners_were_recorded_loads_with_no_owner(tmp_path: Path) -> None:
    store = LocalArtifactStore(tmp_path)
    path = CheckpointPath("s-abc:train:0", WEIGHTS, "old")
    saved = _state(None)
    legacy = {  # the file as save_state wrote it before it recorded the owner
        "adapter_config": saved.adapter_config,
        "tensors": saved.tensors,
        "optimizer": None,
        "base_digest": saved.base_digest,
        "steps": saved.steps,
        "targets": list(saved.targets),
    }
    file = tmp_path / "legacy.pt"
    torch.save(legacy, file)
    store.put_file(path.stored_name, file)
    state = load_state(store, path)
    assert state.owner is None and state.steps == 3
    with pytest.raises(AccessDeniedError, match="only an admin"):
        check_loader(state, path, "team-a", ("admin",), keyed=True)


def forward_ops(model_id: str, count: int, tokens: int) -> list[Op]:
    made = []
    for seq in range(1, count + 1):
        request = read_forward_backward(fb(model_id, [datum(list(range(1, tokens + 1)))]), None)
        made.append(Op(seq, OpKind.FORWARD, f"{model_id}-{seq}", request))
    return made


@pytest.mark.parametrize(
    ("loud_weight", "taken"),
    [(1.0, {"loud-model": 3, "quiet-model": 3}), (3.0, {"loud-model": 4, "quiet-model": 2})],
)
def test_a_round_shares_one_pass_by_weight_when_tenants_want_more(
    loud_weight: float, taken: dict[str, int]
) -> None:
    # 8 and 4 requests of 20 tokens against a pass of 100: weighted max-min shares of 100
    # tokens (50/50, or 75/25), each principal's requests taken while any of it is left.
    runs = {
        "loud-model": ("loud", forward_ops("loud-model", 8, 20)),
        "quiet-model": ("quiet", forward_ops("quiet-model", 4, 20)),
    }
    weight = {"loud": loud_weight, "quiet": 1.0}.__getitem__
    shared = round_share(runs, weight, pass_tokens=100)
    assert {model: len(ops) for model, ops in shared.items()} == taken
    assert [op.seq_id for op in shared["loud-model"]] == list(range(1, taken["loud-model"] + 1))
    # A tenant alone, or everyone within a pass: every ready request goes.
    alone = round_share({"loud-model": runs["loud-model"]}, weight, pass_tokens=100)
    assert len(alone["loud-model"]) == 8
    assert round_share(runs, weight, pass_tokens=240) == {m: ops for m, (_, ops) in runs.items()}
