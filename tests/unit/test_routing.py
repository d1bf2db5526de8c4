"""R3 routing record/replay on tiny MoE bases built from config, and IcePop's mask and loss.

The experts implementation is pinned to eager, the path MinT's trainer and engine compute with
(replay itself only changes what the router hands the experts, whatever the implementation).
"""

import math
from collections.abc import Callable

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from mint_core.errors import ConfigurationError
from mint_core.model.generate import seeded
from mint_core.model.rl import icepop_mask, masked_policy_loss
from mint_core.model.routing import flip_rate, moe_gates, recording_routes, replaying_routes

Make = Callable[[bool], PreTrainedModel]
"""Builds a tiny MoE model from config, given whether its router renormalises its top-k."""
VOCAB = 64
SHARED = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts_per_tok=2,
    max_position_embeddings=64,
    tie_word_embeddings=True,
    experts_implementation="eager",
    initializer_range=0.3,  # large enough that the experts a token meets change its outputs
)


def qwen3_moe(norm_topk_prob: bool) -> PreTrainedModel:
    config = Qwen3MoeConfig(
        **SHARED, num_experts=4, moe_intermediate_size=16, norm_topk_prob=norm_topk_prob
    )
    return Qwen3MoeForCausalLM(config)


def mixtral(norm_topk_prob: bool) -> PreTrainedModel:
    assert norm_topk_prob, "Mixtral's router always renormalises"
    return MixtralForCausalLM(MixtralConfig(**SHARED, num_local_experts=4))


BASES = [
    pytest.param(qwen3_moe, False, id="qwen3_moe-unnormalised"),
    pytest.param(qwen3_moe, True, id="qwen3_moe-normalised"),
    pytest.param(mixtral, True, id="mixtral"),
]


def build(make: Make, normalised: bool, tied: bool = False) -> PreTrainedModel:
    """A seeded fp32 model; `tied` gives near-tied routers (std 1e-3) where experts 1 and 2
    score every token exactly alike, so any router step that tells them apart flips routes."""
    with seeded(0):
        model = make(normalised).float().eval()
        if tied:
            with torch.no_grad():
                for gate in moe_gates(model):
                    torch.nn.init.normal_(gate.module.weight, std=1e-3)
                    gate.module.weight[1] = gate.module.weight[2]
    return model


def token_logprobs(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    """`[batch, seq-1]` log-probability of each next token, as RL scores a completion."""
    logits = model(input_ids=ids).logits[:, :-1].float()
    return logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]


def tokens(batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(("make", "normalised"), BASES)
def test_replaying_own_routes_reproduces_logprobs_and_trains_the_router(
    make: Make, normalised: bool
) -> None:
    model = build(make, normalised)
    ids = tokens(3, 7)
    with torch.no_grad(), recording_routes(model) as routes:
        own = token_logprobs(model, ids)
    assert routes.indices.shape == (3, 7, 2, 2)
    assert routes.row(1).shape == (7, 2, 2)

    with replaying_routes(model, routes):
        replayed = token_logprobs(model, ids)
    torch.testing.assert_close(replayed.detach(), own, atol=1e-6, rtol=0)
    replayed.sum().backward()
    grads = [gate.module.weight.grad for gate in moe_gates(model)]
    assert all(g is not None and g.abs().sum() > 0 for g in grads), "the router got no gradient"
    assert not any(gate.module._forward_hooks for gate in moe_gates(model)), "hooks left behind"


def test_replay_under_an_expert_lora() -> None:
    # The trainer's model: PEFT wraps attention and the fused experts but not the router.
    model = build(qwen3_moe, True)
    config = LoraConfig(
        r=2,
        target_modules=["q_proj", "v_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    model = get_peft_model(model, config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.5)
    ids = tokens(2, 6)
    with torch.no_grad(), recording_routes(model) as routes:
        own = token_logprobs(model, ids)
    with replaying_routes(model, routes):
        replayed = token_logprobs(model, ids)
    torch.testing.assert_close(replayed.detach(), own, atol=1e-6, rtol=0)
    replayed.sum().backward()
    experts = [p.grad for n, p in model.named_parameters() if "experts" in n and "lora_B" in n]
    assert experts and all(g is not None and g.abs().sum() > 0 for g in experts)


@pytest.mark.parametrize(("make", "normalised"), BASES)
def test_replay_undoes_routing_flips_after_a_router_step(make: Make, normalised: bool) -> None:
    # Tied routers so that one small step flips top-k choices, as between a sampler and a
    # trainer one step apart. Replay removes the flips; what remains is O(lr), from the gate
    # weights recomputed with the moved router (1.6e-4 at lr 1e-4, 1.6e-3 at 1e-3).
    model = build(make, normalised, tied=True)
    ids = tokens(64, 32)
    with torch.no_grad(), recording_routes(model) as sampled:
        sampler = token_logprobs(model, ids)

    routers = [gate.module.weight for gate in moe_gates(model)]
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    for weight in routers:
        weight.requires_grad_(True)
    optimizer = torch.optim.SGD(routers, lr=2e-5)
    (-token_logprobs(model, ids).mean()).backward()
    optimizer.step()

    with torch.no_grad():
        with recording_routes(model) as trained:
            free = token_logprobs(model, ids)
        with replaying_routes(model, sampled):
            replayed = token_logprobs(model, ids)
    flips = flip_rate(sampled.indices, trained.indices)
    gap_free = (free - sampler).abs().max().item()
    gap_replayed = (replayed - sampler).abs().max().item()
    figures = f"flip rate {flips:.4f}, gap without replay {gap_free:.3g}, with {gap_replayed:.3g}"
    print(figures)
    assert flips > 0, figures
    assert gap_replayed < gap_free, figures
    assert gap_replayed <= 1e-4, figures


def test_routes_that_do_not_fit_and_dense_bases_are_refused() -> None:
    model = build(qwen3_moe, True)
    ids = tokens(2, 5)
    with torch.no_grad(), recording_routes(model) as routes:
        token_logprobs(model, ids)
    bad = {
        "outside 0..3": routes.indices + 3,
        "repeat an expert": routes.indices[..., :1].expand(-1, -1, -1, 2),
        r"\(layers, top_k\) = \(2, 2\)": routes.indices[:, :, :1],
    }
    for message, table in bad.items():
        with pytest.raises(ConfigurationError, match=message), replaying_routes(model, table):
            token_logprobs(model, ids)
    with pytest.raises(ConfigurationError, match="beyond routes"), replaying_routes(model, routes):
        token_logprobs(model, tokens(2, 6))
    assert flip_rate(routes.indices, routes.indices.flip(-1)) == 0.0

    dense = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in SHARED.items() if "expert" not in k}))
    with pytest.raises(ConfigurationError, match="Qwen3ForCausalLM has no MoE router"):
        moe_gates(dense)


def test_icepop_masks_exactly_the_tokens_outside_the_bounds() -> None:
    ratios = [0.49, 0.5, 0.51, 1.0, 4.99, 5.0, 5.01, 0.0, math.inf]
    inside = [False, True, True, True, True, True, False, False, False]
    # Sampler log-probabilities of 0 make train - sample exactly log(ratio) in float32, so the
    # boundary ratios land on log(0.5) and log(5.0), not a rounding step to either side.
    sample = torch.zeros(len(ratios))
    train = torch.tensor([math.log(r) if r > 0 else -math.inf for r in ratios])
    train[-1] = -1.0
    sample[-1] = -math.inf  # a token the sampler could not have drawn: infinite ratio
    assert icepop_mask(train, sample).tolist() == inside

    advantages = torch.tensor([2.0])
    train.requires_grad_(True)
    completion = torch.ones(len(ratios), dtype=torch.bool)
    completion[3] = False  # a prompt token: neither kept nor counted as dropped
    result = masked_policy_loss(train, sample, advantages, completion)
    kept = torch.tensor(inside) & completion
    expected = -(torch.tensor(ratios)[kept] * 2.0).mean()
    torch.testing.assert_close(result.loss.detach(), expected.float())
    assert result.masked_fraction == pytest.approx(4 / 8)
    result.loss.backward()
    assert train.grad is not None and torch.isfinite(train.grad).all()
    assert (train.grad[~kept] == 0).all() and (train.grad[kept] != 0).all()

    for low, high in [(5.0, 0.5), (0.0, 5.0), (-1.0, 5.0), (0.5, 0.5), (math.nan, 5.0)]:
        with pytest.raises(ConfigurationError, match=f"low={low}, high={high}"):
            icepop_mask(train, sample, low, high)


def test_a_generation_records_its_routes_along_the_sequence() -> None:
    # Prefill then decode steps with a KV cache: each forward's routes join along the sequence,
    # so they line up with one forward over the prompt and all but the last generated token.
    model = build(qwen3_moe, True)
    prompt = tokens(2, 5)
    with torch.no_grad(), recording_routes(model) as generated:
        ids = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=0,
        )
    with torch.no_grad(), recording_routes(model) as scored:
        model(input_ids=ids[:, :-1])
    assert generated.indices.shape == scored.indices.shape == (2, 8, 2, 2)
    assert flip_rate(generated.indices, scored.indices) == 0.0
