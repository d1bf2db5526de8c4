"""LoRA on fused MoE experts (PEFT's `target_parameters`) in training: the families' default
targets, the key rule read with and without the model, and an expert LoRA trained on a tiny
Qwen3-MoE and Mixtral."""

import copy
from pathlib import Path

import pytest
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file

from mint_core.artifacts.freezing import PEFT_WEIGHTS
from mint_core.errors import ConfigurationError
from mint_core.model.base import (
    BaseModel,
    BaseSource,
    default_expert_targets,
    default_targets,
    load_base,
)
from mint_core.model.datasets import parse_jsonl
from mint_core.model.experts import expert_lora_targets, expert_rank, fused_expert_parameter
from mint_core.model.toy import Task, write_held_out_data, write_task_data
from mint_core.model.training import TrainingConfig, train_lora
from tests.helpers import MOE_FAMILIES, family_folder

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("experts-home")


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def folder(request: pytest.FixtureRequest, home: Path) -> Path:
    return family_folder(request.param, home)


def moe_base(folder: Path, home: Path) -> BaseModel:
    return load_base(BaseSource(str(folder)), home)


def test_moe_families_adapt_attention_and_both_expert_projections(folder: Path, home: Path) -> None:
    model = moe_base(folder, home).model
    assert default_targets(model) == ATTENTION
    targets = expert_lora_targets(model, default_expert_targets(model))
    assert {key: t.parameter for key, t in targets.items()} == {
        f"model.layers.{layer}.mlp.experts{nest}": parameter
        for layer in (0, 1)
        for nest, parameter in ((".base_layer", "gate_up_proj"), ("", "down_proj"))
    }
    # Packing reads the same rule without the model, from the PEFT key alone.
    for patterns in (default_expert_targets(model), ("down_proj",), ("gate_up_proj",)):
        for key, target in expert_lora_targets(model, patterns).items():
            read = fused_expert_parameter(f"base_model.model.{key}", patterns)
            assert read == (f"base_model.model.{target.module}", target.parameter)
    assert fused_expert_parameter("model.layers.0.mlp.experts.base_layer", ("down_proj",)) is None
    assert fused_expert_parameter("model.layers.0.self_attn.q_proj", ("down_proj",)) is None


def test_expert_rank_follows_the_rank_pattern_peft_writes(home: Path) -> None:
    """PEFT turns `gate_proj`/`up_proj` targets on Qwen3-MoE's fused experts into
    `gate_up_proj` at twice the rank, saying so in `rank_pattern`; the rank MinT reads is the
    one PEFT trained."""
    model = moe_base(family_folder("qwen3_moe", home), home).model
    peft = get_peft_model(
        copy.deepcopy(model), LoraConfig(r=2, target_modules=["gate_proj", "up_proj", "down_proj"])
    )
    config = peft.peft_config["default"].to_dict()
    assert set(config["target_parameters"]) == {"gate_up_proj", "down_proj"}
    experts = {
        t.parameter: t for t in expert_lora_targets(model, config["target_parameters"]).values()
    }
    weights = dict(peft.named_parameters())
    for parameter, rank in (("gate_up_proj", 4), ("down_proj", 2)):
        target = experts[parameter]
        assert expert_rank(config, target.module, parameter) == rank
        a = weights[f"base_model.model.{target.key}.lora_A.default.weight"]
        assert a.shape == (rank * target.experts, target.in_features)


def rows(tmp_path: Path):  # type: ignore[no-untyped-def]
    return (
        parse_jsonl(path.read_bytes(), str(path))
        for path in (
            write_task_data(Task.REVERSE, tmp_path / "data", rows=64),
            write_held_out_data(Task.REVERSE, tmp_path / "data", count=4),
        )
    )


def test_an_expert_lora_trains_on_a_tiny_moe(folder: Path, home: Path, tmp_path: Path) -> None:
    data, held_out = rows(tmp_path)
    config = TrainingConfig(rank=2, steps=4, batch_size=8, learning_rate=1e-2)
    trained = train_lora(BaseSource(str(folder)), home, data, held_out, tmp_path / "a", config)
    assert trained.target_modules == ATTENTION
    assert trained.target_parameters == ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    assert trained.policy_fields()["target_parameters"] == trained.target_parameters
    weights = load_file(trained.path / PEFT_WEIGHTS)
    experts = {k: v for k, v in weights.items() if ".mlp.experts." in k}
    # 2 layers x {gate_up_proj (inner wrapper), down_proj} x {A, B}, rank 2 x 4 experts.
    assert len(experts) == 8
    gate_up_b = experts["base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.weight"]
    down_a = experts["base_model.model.model.layers.1.mlp.experts.lora_A.weight"]
    assert gate_up_b.shape[1] == down_a.shape[0] == 2 * 4
    # PEFT starts B at zero: only the optimizer moved them, so the experts got gradients.
    for key, tensor in experts.items():
        if key.endswith("lora_B.weight"):
            assert tensor.abs().max() > 1e-4, key


def test_expert_targets_none_and_refusals(folder: Path, home: Path, tmp_path: Path) -> None:
    data, held_out = rows(tmp_path)
    source = BaseSource(str(folder))
    plain = train_lora(source, home, data, held_out, tmp_path / "plain",
                       TrainingConfig(rank=2, steps=1, expert_targets=()))  # fmt: skip
    assert plain.target_parameters == ()
    assert not any(".experts." in key for key in load_file(plain.path / PEFT_WEIGHTS))
    with pytest.raises(ConfigurationError, match=r"dropout=0\.1 .*supports no dropout"):
        train_lora(source, home, data, held_out, tmp_path / "d",
                   TrainingConfig(rank=2, steps=1, dropout=0.1))  # fmt: skip
    with pytest.raises(ConfigurationError, match=r"\['mlp\.experts\.w9'\] select no fused"):
        train_lora(source, home, data, held_out, tmp_path / "w",
                   TrainingConfig(rank=2, steps=1, expert_targets=("mlp.experts.w9",)))  # fmt: skip
    # Dropout stays available to an MoE base's attention-only LoRA.
    train_lora(source, home, data, held_out, tmp_path / "attn",
               TrainingConfig(rank=2, steps=1, dropout=0.1, expert_targets=()))  # fmt: skip


def test_a_dense_base_has_no_expert_targets(home: Path, tmp_path: Path) -> None:
    dense = moe_base(family_folder("llama", home), home).model
    assert default_expert_targets(dense) == ()
    data, held_out = rows(tmp_path)
    with pytest.raises(ConfigurationError, match=r"select no fused expert parameter"):
        train_lora(BaseSource(str(family_folder("llama", home))), home, data, held_out,
                   tmp_path / "x",
                   TrainingConfig(steps=1, expert_targets=("down_proj",)))  # fmt: skip
