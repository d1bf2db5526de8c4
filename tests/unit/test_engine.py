"""The multi-LoRA engine's exactness, on a tiny member of each model family it serves (Llama,
Qwen2 with q/k/v biases, Qwen3 with q/k norms and a head size of its own, Mistral; grouped-query
attention, tied and untied embeddings): gathered per-row deltas in one batch give what each
adapter gives alone, what PEFT's own PeftModel gives, and the base bit for bit where the adapter
is zero."""

import re
from pathlib import Path

import pytest
import torch
from peft import PeftModel

from mint_core.errors import ConfigurationError, IntegrityError, ServiceError
from mint_core.model.base import BaseModel, BaseSource, load_base, servable_modules
from mint_core.model.generate import greedy_generate, pad_left
from serving.engine.engine import BASE, TorchEngine, positions
from tests.helpers import (
    DENSE_FAMILIES,
    PROJECTIONS,
    config_of,
    family_folder,
    random_adapter,
    weights_of,
)
from tests.helpers import ENGINE_PROMPTS as PROMPTS

RANKS = [1, 2, 4, 8, 16, 3, 8, 5]


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-home")


# Dense families: these tests adapt every linear layer, and an MoE family's experts are fused
# parameters, not linear layers (the engine's expert LoRA is test_engine_experts.py).
@pytest.fixture(scope="module", params=DENSE_FAMILIES)
def folder(request: pytest.FixtureRequest, home: Path) -> Path:
    return family_folder(request.param, home)


def fresh_base(folder: Path, home: Path) -> BaseModel:
    """A base the engine may own (it adapts its model in place)."""
    return load_base(BaseSource(str(folder)), home)


@torch.inference_mode()
def peft_logits(model: PeftModel, base: BaseModel, prompts: list[str]) -> torch.Tensor:
    ids, mask = pad_left([base.codec.encode(p) for p in prompts], base.codec.pad_id)
    return model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits[:, -1]


def test_the_engine_wraps_every_linear_layer_by_name_the_output_embedding_too(
    folder: Path, home: Path
) -> None:
    names = set(servable_modules(fresh_base(folder, home).model, output=True))
    engine = TorchEngine(fresh_base(folder, home))
    assert set(engine._wrappers) == names
    assert {name.rsplit(".", 1)[-1] for name in names} == {*PROJECTIONS, "lm_head"}


def test_a_lora_of_the_output_embedding_gives_what_peft_gives(folder: Path, home: Path) -> None:
    """`mint trainer`'s tenants adapt lm_head by default (the Tinker SDK's `train_unembed`)."""
    lora, model = random_adapter(
        fresh_base(folder, home), rank=2, seed=1, targets=["q_proj", "lm_head"]
    )
    engine = TorchEngine(fresh_base(folder, home))
    # PEFT would save the (tied) embedding too; an adapter carries its LoRA pairs only.
    pairs = {k: v for k, v in weights_of(model).items() if ".lora_" in k}
    engine.load(engine.prepare("head", config_of(lora), pairs))
    mixed = engine.logits(PROMPTS, ["head", BASE] * (len(PROMPTS) // 2))
    peft = peft_logits(model, engine.base, PROMPTS)
    torch.testing.assert_close(mixed[0::2], peft[0::2], rtol=0, atol=1e-5)
    assert not torch.allclose(mixed[1::2], peft[1::2])


def test_a_zero_adapter_gives_the_base_logits_bit_for_bit(folder: Path, home: Path) -> None:
    reference = fresh_base(folder, home)
    base_logits = TorchEngine(reference).logits(PROMPTS, [BASE] * len(PROMPTS))
    lora, model = random_adapter(fresh_base(folder, home), rank=4, seed=0)
    zeros = {k: torch.zeros_like(v) for k, v in weights_of(model).items()}
    engine = TorchEngine(fresh_base(folder, home))
    engine.load(engine.prepare("zero", config_of(lora), zeros))
    engine.load(engine.prepare("busy", config_of(lora), weights_of(model)))
    keys = ["zero", "busy"] * (len(PROMPTS) // 2)
    mixed = engine.logits(PROMPTS, keys)
    assert torch.equal(mixed[0::2], base_logits[0::2])
    assert not torch.equal(mixed[1::2], base_logits[1::2])


def test_a_mixed_batch_gives_each_row_what_its_adapter_gives_alone_and_what_peft_gives(
    folder: Path, home: Path
) -> None:
    engine = TorchEngine(fresh_base(folder, home))
    adapters = {}
    for number, rank in enumerate(RANKS):
        targets = PROJECTIONS if number % 3 else ["q_proj", "v_proj", "down_proj"]
        lora, model = random_adapter(fresh_base(folder, home), rank, seed=number, targets=targets)
        engine.load(engine.prepare(f"a{number}", config_of(lora), weights_of(model)))
        adapters[f"a{number}"] = model
    # Every adapter and two base rows, each on its own prompt, in one batch.
    keys = [*adapters, BASE, BASE]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(keys))]

    mixed = engine.logits(prompts, keys)
    mixed_tokens = engine.generate(prompts, keys, 12)
    for row, (key, prompt) in enumerate(zip(keys, prompts, strict=True)):
        alone = engine.logits([prompt], [key])[0]
        torch.testing.assert_close(mixed[row], alone, rtol=0, atol=1e-5)
        assert engine.generate([prompt], [key], 12)[0].token_ids == mixed_tokens[row].token_ids
        if key != BASE:
            peft = peft_logits(adapters[key], engine.base, [prompt])[0]
            torch.testing.assert_close(mixed[row], peft, rtol=0, atol=1e-5)
            ids = [engine.codec.encode(prompt)]
            peft_tokens = greedy_generate(adapters[key], engine.codec, ids, 12)
            assert peft_tokens[0].token_ids == mixed_tokens[row].token_ids


def test_adapters_that_do_not_fit_or_exceed_the_slots_are_refused(home: Path) -> None:
    llama = family_folder("llama", home)
    engine = TorchEngine(fresh_base(llama, home), slots=2)
    lora, model = random_adapter(fresh_base(llama, home), rank=2, seed=1)
    for key in ("one", "two"):
        engine.load(engine.prepare(key, config_of(lora), weights_of(model)))
    with pytest.raises(ServiceError, match="all 2 device slots hold adapters"):
        engine.load(engine.prepare("three", config_of(lora), weights_of(model)))
    engine.unload("one")
    engine.load(engine.prepare("three", config_of(lora), weights_of(model)))
    engine.unload("two")

    # Made for another family (Qwen3: heads of 32 on a width of 64, 2 key/value heads).
    lora, model = random_adapter(fresh_base(family_folder("qwen3", home), home), rank=2, seed=1)
    at = re.escape("(llama) at model.layers.0.self_attn.q_proj")
    with pytest.raises(
        IntegrityError, match=rf"does not fit the base \S+ {at}: .* base projection 64x64"
    ):
        engine.load(engine.prepare("alien", config_of(lora), weights_of(model)))
    # A LoRA of the input embedding: no linear layer the engine serves.
    targets = ["q_proj", "embed_tokens"]
    lora, model = random_adapter(fresh_base(llama, home), rank=2, seed=1, targets=targets)
    with pytest.raises(IntegrityError, match=r"\(llama\): tensor '[^']*embed_tokens\.lora_"):
        engine.prepare("embedding", config_of(lora), weights_of(model))
    assert engine.adapters == frozenset({"three"})


def slot_bytes(engine: TorchEngine) -> int:
    """Bytes the engine's linear wrappers hold in device slots."""
    return sum(
        a_t.nbytes + b_t.nbytes
        for wrapper in engine._wrappers.values()
        for a_t, b_t, _ in wrapper.pairs.values()
    )


def test_device_slots_are_allocated_when_filled_each_for_its_own_rank(home: Path) -> None:
    llama = family_folder("llama", home)
    engine = TorchEngine(fresh_base(llama, home), slots=64)
    assert slot_bytes(engine) == 0  # 64 slots, none allocated before an adapter fills one
    nbytes = {}
    for rank in (16, 2):
        lora, model = random_adapter(fresh_base(llama, home), rank=rank, seed=rank)
        weights = engine.prepare(f"r{rank}", config_of(lora), weights_of(model))
        engine.load(weights)
        nbytes[rank] = weights.nbytes
    # The rank-2 adapter is not widened to the rank-16 one's rank, and no other slot is.
    assert slot_bytes(engine) == nbytes[16] + nbytes[2]
    engine.unload("r16")
    assert slot_bytes(engine) == nbytes[2]


@pytest.mark.parametrize(
    ("bad", "counts"), [(float("nan"), "1 NaN and 0"), (float("inf"), "0 NaN and 1")]
)
def test_an_adapter_with_a_weight_that_is_not_finite_is_refused_naming_the_tensor(
    home: Path, bad: float, counts: str
) -> None:
    llama = family_folder("llama", home)
    engine = TorchEngine(fresh_base(llama, home))
    lora, model = random_adapter(fresh_base(llama, home), rank=2, seed=0)
    tensors = weights_of(model)
    name = sorted(tensors)[3]
    tensors[name][1, 0] = bad
    with pytest.raises(
        ConfigurationError, match=rf"adapter spoiled: tensor {re.escape(repr(name))} holds {counts}"
    ):
        engine.prepare("spoiled", config_of(lora), tensors)
    assert engine.adapters == frozenset()
