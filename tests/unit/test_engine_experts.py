"""Expert LoRA on the engine, on a tiny Qwen3-MoE: adapters of the fused experts (PEFT's
`target_parameters`, with attention projections beside them) mix in one batch with an
attention-only adapter and base rows, each row getting what it gets alone and what PEFT's
PeftModel gives (which serves such adapters only one at a time), through the packed format as
a worker reads it, at prefill and at every decode step over the key/value cache."""

import copy
import warnings
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from mint_core.artifacts.packing import load, pack_tensors
from mint_core.errors import IntegrityError
from mint_core.model.base import BaseModel
from mint_core.model.experts import experts_modules
from mint_core.model.generate import pad_left
from mint_core.model.tiny import TinySpec
from serving.engine.engine import BASE, AdapterWeights, TorchEngine, positions
from serving.engine.lora import SlotLoraExperts
from tests.helpers import ENGINE_PROMPTS as PROMPTS
from tests.helpers import config_of, random_lora, tiny_base, weights_of

SPEC = TinySpec(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=32, num_experts=4,
                pretrain_steps=0)  # fmt: skip
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ADAPTERS = {
    "experts-r2": LoraConfig(
        r=2, lora_alpha=5, use_rslora=True, target_modules=ATTENTION, target_parameters=EXPERTS
    ),
    # alpha_pattern reaches a fused parameter by its `module.parameter` name, as PEFT's does.
    "experts-r4": LoraConfig(
        r=4,
        lora_alpha=8,
        alpha_pattern={"down_proj": 3.0},
        target_modules=ATTENTION,
        target_parameters=EXPERTS,
    ),
    # One adapted parameter alone: its pair is saved under `mlp.experts`, no `base_layer`.
    "down-r3": LoraConfig(
        r=3, lora_alpha=6, target_modules=["q_proj"], target_parameters=["mlp.experts.down_proj"]
    ),
    "attention": LoraConfig(r=3, lora_alpha=6, target_modules=ATTENTION),
}
KEYS = ["experts-r2", BASE, "experts-r4", "attention", "down-r3", BASE, "experts-r4", "experts-r2"]
DECODE_STEPS = 8


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-experts-home")


@pytest.fixture(scope="module")
def peft_models(home: Path) -> dict[str, PeftModel]:
    base = tiny_base(SPEC, home)
    with warnings.catch_warnings():
        # PEFT checks alpha_pattern against targeted modules only, not parameters; the
        # comparison with PeftModel shows it applies the pattern to the fused down_proj anyway.
        warnings.filterwarnings("ignore", "The following alpha_pattern keys did not match")
        return {
            key: random_lora(base.model, lora, seed, std=0.2)
            for seed, (key, lora) in enumerate(ADAPTERS.items())
        }


@pytest.fixture(scope="module")
def engine(home: Path, peft_models: dict[str, PeftModel]) -> TorchEngine:
    """An engine holding every adapter, each taken through pack and load as a worker gets it."""
    engine = TorchEngine(tiny_base(SPEC, home), slots=len(ADAPTERS) + 1)
    for key, model in peft_models.items():
        tensors = weights_of(model)
        pack_tensors(adapter_config(ADAPTERS[key]), tensors, home / "packed" / key)
        packed = load(home / "packed" / key)
        read = packed.peft_state_dict()
        assert read.keys() == tensors.keys()
        assert all(torch.equal(read[name], tensors[name]) for name in tensors)
        weights = engine.prepare(key, packed.index.adapter_config, read)
        assert weights.nbytes == sum(t.nbytes for t in tensors.values())
        engine.load(weights)
    return engine


def adapter_config(lora: LoraConfig) -> dict[str, object]:
    """The adapter config an engine is given, as a packed index holds it (JSON: lists)."""
    return config_of(lora) | {"target_parameters": sorted(lora.target_parameters or [])}


@torch.inference_mode()
def peft_logits(model: PeftModel, base: BaseModel, prompt: str) -> torch.Tensor:
    ids, mask = pad_left([base.codec.encode(prompt)], base.codec.pad_id)
    return model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits[0, -1]


def decode(engine: TorchEngine, prompts: list[str], keys: list[str]) -> tuple[torch.Tensor, ...]:
    """Greedy tokens `[batch, DECODE_STEPS]` and each step's logits, through `step` and its
    key/value cache, as the scheduler runs a batch."""
    rows = [engine.codec.encode(prompt) for prompt in prompts]
    input_ids, mask = pad_left(rows, engine.codec.pad_id)
    slots = [engine.slot_of(key) for key in keys]
    logits, cache, _ = engine.step(input_ids, mask, slots, None)
    tokens, steps = [], [logits]
    for _ in range(DECODE_STEPS - 1):
        tokens.append(logits.argmax(-1))
        mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=mask.dtype)], dim=1)
        logits, cache, _ = engine.step(tokens[-1][:, None], mask, slots, cache)
        steps.append(logits)
    tokens.append(logits.argmax(-1))
    return torch.stack(tokens, 1), *steps


def test_the_engine_wraps_every_fused_experts_module_and_keeps_its_parameter_names(
    home: Path, engine: TorchEngine
) -> None:
    names = set(experts_modules(tiny_base(SPEC, home).model))
    assert names == set(engine._experts) == set(experts_modules(engine.base.model))
    assert len(names) == SPEC.num_layers
    assert all(isinstance(engine.base.model.get_submodule(n), SlotLoraExperts) for n in names)
    served = {n.replace(".base.", ".") for n, _ in engine.base.model.named_parameters()}
    assert served == dict(tiny_base(SPEC, home).model.named_parameters()).keys()


def test_a_mixed_batch_gives_each_row_what_it_gives_alone_and_what_peft_gives(
    engine: TorchEngine, peft_models: dict[str, PeftModel]
) -> None:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(KEYS))]
    mixed = engine.logits(prompts, KEYS)
    alone_gap, peft_gap = 0.0, 0.0
    for row, (key, prompt) in enumerate(zip(KEYS, prompts, strict=True)):
        alone = engine.logits([prompt], [key])[0]
        torch.testing.assert_close(mixed[row], alone, rtol=0, atol=1e-5)
        alone_gap = max(alone_gap, (mixed[row] - alone).abs().max().item())
        if key != BASE:
            peft = peft_logits(peft_models[key], engine.base, prompt)
            torch.testing.assert_close(mixed[row], peft, rtol=0, atol=1e-5)
            peft_gap = max(peft_gap, (mixed[row] - peft).abs().max().item())
    base = engine.logits(prompts, [BASE] * len(KEYS))
    adapted = [row for row, key in enumerate(KEYS) if key != BASE]
    effect = (mixed - base).abs().amax(-1)[adapted]
    print(f"max |mixed - alone| {alone_gap:.2e}, max |mixed - PeftModel| {peft_gap:.2e}, "
          f"adapters move the logits by {effect.min():.2f}..{effect.max():.2f}")  # fmt: skip
    # Every adapter row differs from the base: the comparisons above are not trivially met.
    assert effect.min() > 0.05


def test_decode_steps_over_the_cache_give_each_row_what_it_gives_alone(
    engine: TorchEngine,
) -> None:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(KEYS))]
    tokens, *steps = decode(engine, prompts, KEYS)
    gap = 0.0
    for row, (key, prompt) in enumerate(zip(KEYS, prompts, strict=True)):
        alone_tokens, *alone_steps = decode(engine, [prompt], [key])
        assert tokens[row].tolist() == alone_tokens[0].tolist()
        for mixed, alone in zip(steps, alone_steps, strict=True):
            torch.testing.assert_close(mixed[row], alone[0], rtol=0, atol=1e-5)
            gap = max(gap, (mixed[row] - alone[0]).abs().max().item())
    print(f"max |mixed - alone| over {DECODE_STEPS} steps: {gap:.2e}")
    assert len({tuple(row) for row in tokens.tolist()}) > 2  # the rows did not all collapse


def test_a_zero_expert_adapter_gives_the_base_logits_bit_for_bit(
    home: Path, engine: TorchEngine
) -> None:
    base = tiny_base(SPEC, home)
    zero = get_peft_model(copy.deepcopy(base.model), copy.deepcopy(ADAPTERS["experts-r2"]))
    tensors = weights_of(zero)
    assert all(not t.any() for n, t in tensors.items() if "lora_B" in n)  # PEFT's init
    reference = TorchEngine(base).logits(PROMPTS, [BASE] * len(PROMPTS))
    engine.load(engine.prepare("zero", adapter_config(ADAPTERS["experts-r2"]), tensors))
    try:
        keys = ["zero", "experts-r4"] * (len(PROMPTS) // 2)
        mixed = engine.logits(PROMPTS, keys)
        assert torch.equal(mixed[0::2], reference[0::2])
        assert not torch.equal(mixed[1::2], reference[1::2])
    finally:
        engine.unload("zero")


def test_expert_pairs_that_do_not_fit_are_refused(
    engine: TorchEngine, peft_models: dict[str, PeftModel]
) -> None:
    tensors = weights_of(peft_models["experts-r4"])
    gate_up_a = "base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight"
    # One row short of rank x experts.
    short = tensors | {gate_up_a: tensors[gate_up_a][:-1]}
    with pytest.raises(IntegrityError, match=r"at model\.layers\.1\.mlp\.experts\.gate_up_proj: "
                       r"A \[15, 64\], B \[64, 16\], base experts 4x64x64"):  # fmt: skip
        engine.prepare("short", adapter_config(ADAPTERS["experts-r4"]), short)
    # Without target_parameters in its config, the fused pairs are no module's.
    attention_only = adapter_config(ADAPTERS["attention"])
    with pytest.raises(IntegrityError, match=r"tensor '[^']*mlp\.experts\.base_layer\.lora_A"):
        engine.prepare("unnamed", attention_only, tensors)
    assert engine.adapters == frozenset(ADAPTERS)
    assert isinstance(engine.prepare("ok", adapter_config(ADAPTERS["experts-r4"]), tensors),
                      AdapterWeights)  # fmt: skip
