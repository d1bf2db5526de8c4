"""The multi-LoRA engine's exactness: gathered per-row deltas in one batch give what each
adapter gives alone, what PEFT's own PeftModel gives, and the base bit for bit where the
adapter is zero."""

import re
from pathlib import Path

import pytest
import torch
from peft import PeftModel

from mint_core.base_model import BaseModel, BaseModelSpec, load_base
from mint_core.errors import ConfigurationError, IntegrityError, ServiceError
from mint_core.textgen import greedy_generate, left_padded
from mint_core.tokenizer import CharTokenizer
from serving.engine import BASE, TorchEngine
from tests.helpers import ENGINE_PROMPTS as PROMPTS
from tests.helpers import ENGINE_SPEC as SPEC
from tests.helpers import PROJECTIONS, config_of, random_adapter, weights_of

RANKS = [1, 2, 4, 8, 16, 3, 8, 5]


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-home")


def fresh_base(home: Path) -> BaseModel:
    """A base the engine may own (it adapts its model in place)."""
    return load_base(SPEC, home)


@torch.inference_mode()
def peft_logits(model: PeftModel, prompts: list[str]) -> torch.Tensor:
    ids, mask = left_padded(CharTokenizer(), prompts)
    return model(input_ids=ids, attention_mask=mask).logits[:, -1]


def test_a_zero_adapter_gives_the_base_logits_bit_for_bit(home: Path) -> None:
    reference = fresh_base(home)
    base_logits = TorchEngine(reference).logits(PROMPTS, [BASE] * len(PROMPTS))
    lora, model = random_adapter(fresh_base(home), rank=4, seed=0)
    zeros = {k: torch.zeros_like(v) for k, v in weights_of(model).items()}
    engine = TorchEngine(fresh_base(home))
    engine.load(engine.prepare("zero", config_of(lora), zeros))
    engine.load(engine.prepare("busy", config_of(lora), weights_of(model)))
    keys = ["zero", "busy"] * (len(PROMPTS) // 2)
    mixed = engine.logits(PROMPTS, keys)
    assert torch.equal(mixed[0::2], base_logits[0::2])
    assert not torch.equal(mixed[1::2], base_logits[1::2])


def test_a_mixed_batch_gives_each_row_what_its_adapter_gives_alone_and_what_peft_gives(
    home: Path,
) -> None:
    engine = TorchEngine(fresh_base(home))
    adapters = {}
    for number, rank in enumerate(RANKS):
        targets = PROJECTIONS if number % 3 else ["q_proj", "v_proj", "down_proj"]
        lora, model = random_adapter(fresh_base(home), rank, seed=number, targets=targets)
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
            torch.testing.assert_close(mixed[row], peft_logits(adapters[key], [prompt])[0],
                                       rtol=0, atol=1e-5)  # fmt: skip
            peft_tokens = greedy_generate(adapters[key], CharTokenizer(), [prompt], 12)
            assert peft_tokens[0].token_ids == mixed_tokens[row].token_ids


def test_adapters_that_do_not_fit_or_exceed_the_slots_are_refused(home: Path) -> None:
    engine = TorchEngine(fresh_base(home), slots=2)
    lora, model = random_adapter(fresh_base(home), rank=2, seed=1)
    for key in ("one", "two"):
        engine.load(engine.prepare(key, config_of(lora), weights_of(model)))
    with pytest.raises(ServiceError, match="all 2 device slots hold adapters"):
        engine.load(engine.prepare("three", config_of(lora), weights_of(model)))
    engine.unload("one")
    engine.load(engine.prepare("three", config_of(lora), weights_of(model)))
    other = load_base(BaseModelSpec(hidden_size=32, num_layers=2, num_heads=2,
                                    intermediate_size=64, pretrain_steps=0), home)  # fmt: skip
    lora, model = random_adapter(other, rank=2, seed=1)
    engine.unload("two")
    with pytest.raises(IntegrityError, match="does not fit the base"):
        engine.load(engine.prepare("alien", config_of(lora), weights_of(model)))


@pytest.mark.parametrize(
    ("bad", "counts"), [(float("nan"), "1 NaN and 0"), (float("inf"), "0 NaN and 1")]
)
def test_an_adapter_with_a_weight_that_is_not_finite_is_refused_naming_the_tensor(
    home: Path, bad: float, counts: str
) -> None:
    engine = TorchEngine(fresh_base(home))
    lora, model = random_adapter(fresh_base(home), rank=2, seed=0)
    tensors = weights_of(model)
    name = sorted(tensors)[3]
    tensors[name][1, 0] = bad
    with pytest.raises(
        ConfigurationError, match=rf"adapter spoiled: tensor {re.escape(repr(name))} holds {counts}"
    ):
        engine.prepare("spoiled", config_of(lora), tensors)
    assert engine.adapters == frozenset()
