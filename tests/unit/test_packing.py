"""The packed format on MoE-shaped adapters: stacking, round trips, input layouts, corruption,
and serving a packed adapter exactly as its unpacked PEFT form."""

import json
from pathlib import Path

import pytest
import torch
import xxhash
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file, save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from bench.synthetic import MoeLoraShape, moe_adapter_config, moe_lora_tensors
from mint_core.artifacts.freezing import PEFT_CONFIG, PEFT_WEIGHTS, freeze
from mint_core.artifacts.packing import (
    load,
    map_file,
    pack,
    pack_tensors,
    read_adapter,
    read_into,
    unpack,
    verify,
)
from mint_core.errors import ConfigurationError, IntegrityError
from mint_core.model.base import BaseSource, load_base
from mint_core.model.datasets import parse_jsonl
from mint_core.model.tiny import TinySpec, ensure_tiny
from mint_core.model.toy import (
    Task,
    held_out_words,
    prompt_for,
    write_held_out_data,
    write_task_data,
)
from mint_core.model.training import TrainingConfig, train_lora
from serving.engine.engine import TorchEngine
from tests.helpers import random_lora

SMALL_MOE = MoeLoraShape(layers=3, experts=4, hidden=64, expert_intermediate=32, query_heads=4,
                         kv_heads=2, head_dim=16, rank=2)  # fmt: skip


def write_peft(folder: Path, config: dict[str, object], tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / PEFT_WEIGHTS, metadata={"format": "pt"})
    (folder / PEFT_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
    return folder


def assert_same_tensors(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> None:
    assert left.keys() == right.keys()
    for key in left:
        assert left[key].dtype == right[key].dtype, key
        assert torch.equal(left[key], right[key]), key


def test_moe_experts_are_stacked_per_layer_projection_and_side(tmp_path: Path) -> None:
    tensors = moe_lora_tensors(SMALL_MOE)
    assert len(tensors) == SMALL_MOE.tensor_count == 3 * (4 * 3 * 2 + 8)
    index = pack_tensors(moe_adapter_config(SMALL_MOE), tensors, tmp_path / "packed")
    # 3 expert projections x {A, B} stacked + 8 attention tensors, per layer.
    assert len(index.tensors) == 3 * 14
    loaded = load(tmp_path / "packed")
    stack = loaded.tensors["base_model.model.model.layers.1.mlp.experts.down_proj.lora_B.stacked"]
    assert stack.shape == (4, 64, 2)
    assert stack.dtype == torch.bfloat16
    assert torch.equal(
        stack[3], tensors["base_model.model.model.layers.1.mlp.experts.3.down_proj.lora_B.weight"]
    )
    assert_same_tensors(loaded.peft_state_dict(), tensors)


@pytest.mark.parametrize("shard_bytes", [1 << 30, 8 << 10])
def test_unpack_restores_the_exact_peft_layout(tmp_path: Path, shard_bytes: int) -> None:
    config, tensors = moe_adapter_config(SMALL_MOE), moe_lora_tensors(SMALL_MOE)
    source = write_peft(tmp_path / "peft", config, tensors)
    index = pack(freeze(source, tmp_path / "frozen"), tmp_path / "packed", shard_bytes)
    assert (len(index.shards) == 1) == (shard_bytes == 1 << 30)
    unpack(tmp_path / "packed", tmp_path / "unpacked")
    assert_same_tensors(load_file(tmp_path / "unpacked" / PEFT_WEIGHTS), tensors)
    restored = (tmp_path / "unpacked" / PEFT_CONFIG).read_text()
    assert restored == (source / PEFT_CONFIG).read_text()


def test_one_file_per_tensor_packs_to_the_same_content(tmp_path: Path) -> None:
    config, tensors = moe_adapter_config(SMALL_MOE), moe_lora_tensors(SMALL_MOE)
    per_file = tmp_path / "files"
    write_peft(per_file, config, {})
    (per_file / PEFT_WEIGHTS).unlink()
    for number, (key, tensor) in enumerate(tensors.items()):
        save_file({key: tensor}, per_file / f"t{number:06d}.safetensors")
    from_files = pack_tensors(*read_adapter(per_file), tmp_path / "a")
    from_peft = pack_tensors(
        *read_adapter(write_peft(tmp_path / "peft", config, tensors)), tmp_path / "b"
    )
    assert from_files.content_digest == from_peft.content_digest


def test_content_digest_names_the_tensors_not_how_they_are_packed(tmp_path: Path) -> None:
    config, tensors = moe_adapter_config(SMALL_MOE), moe_lora_tensors(SMALL_MOE)
    one = pack_tensors(config, tensors, tmp_path / "one", shard_bytes=1 << 30)
    many = pack_tensors(config, tensors, tmp_path / "many", shard_bytes=8 << 10)
    assert len(one.shards) == 1 < len(many.shards)
    assert one.content_digest == many.content_digest
    assert verify(tmp_path / "many") == many
    # Whatever the adapter is made of is part of it: a value, the config.
    key = next(iter(tensors))
    changed = {**tensors, key: tensors[key].clone()}
    changed[key].view(-1)[0] += 1
    assert pack_tensors(config, changed, tmp_path / "value").content_digest != one.content_digest
    other_config = {**config, "lora_alpha": 99}
    assert (
        pack_tensors(other_config, tensors, tmp_path / "config").content_digest
        != one.content_digest
    )


def test_verify_checks_the_tensors_against_the_content_digest(tmp_path: Path) -> None:
    """Shards that match their index entries but hold other tensors are refused."""
    config, tensors = moe_adapter_config(SMALL_MOE), moe_lora_tensors(SMALL_MOE)
    genuine = pack_tensors(config, tensors, tmp_path / "genuine")
    swapped = {key: tensor.flip(0) for key, tensor in tensors.items()}
    pack_tensors(config, swapped, tmp_path / "forged")
    index = tmp_path / "forged" / "index.json"
    forged = json.loads(index.read_text())
    forged["content_digest"] = genuine.content_digest
    index.write_text(json.dumps(forged))
    with pytest.raises(IntegrityError, match=f"its index says {genuine.content_digest}"):
        verify(tmp_path / "forged")


def test_packing_again_into_a_folder_replaces_what_was_there(tmp_path: Path) -> None:
    config, tensors = moe_adapter_config(SMALL_MOE), moe_lora_tensors(SMALL_MOE)
    pack_tensors(config, tensors, tmp_path / "packed", shard_bytes=8 << 10)
    index = pack_tensors(config, tensors, tmp_path / "packed", shard_bytes=1 << 30)
    assert sorted(p.name for p in (tmp_path / "packed").iterdir()) == [
        "index.json",
        index.shards[0].name,
    ]


def test_fused_experts_layout_of_installed_peft_packs_and_round_trips(tmp_path: Path) -> None:
    """transformers 5 fuses a layer's experts into 3-D parameters; PEFT's LoRA on them has its
    own keys, which pack as they are."""
    model = Qwen3MoeForCausalLM(
        Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                       moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2)
    )  # fmt: skip
    peft_model = get_peft_model(
        model,
        LoraConfig(r=2, target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]),
    )
    peft_model.save_pretrained(tmp_path / "peft", save_embedding_layers=False)
    tensors = load_file(tmp_path / "peft" / PEFT_WEIGHTS)
    assert any(".mlp.experts." in key for key in tensors)
    assert tensors.keys() == get_peft_model_state_dict(peft_model).keys()
    index = pack(freeze(tmp_path / "peft", tmp_path / "frozen"), tmp_path / "packed")
    # PEFT fused gate_proj and up_proj into gate_up_proj at rank 4 (its rank_pattern says so):
    # either way, 4 experts.
    ranks = {(t.key.count(".base_layer"), t.fused.rank, t.fused.experts)
             for t in index.tensors.values() if t.fused}  # fmt: skip
    assert ranks == {(1, 4, 4), (0, 2, 4)}
    unpack(tmp_path / "packed", tmp_path / "unpacked")
    assert_same_tensors(load_file(tmp_path / "unpacked" / PEFT_WEIGHTS), tensors)


def test_unexpected_keys_are_refused_by_name(tmp_path: Path) -> None:
    tensors = moe_lora_tensors(SMALL_MOE)
    tensors["base_model.model.model.layers.0.mlp.router.weight"] = torch.zeros(2, 2)
    with pytest.raises(
        ConfigurationError, match=r"'base_model\.model\.model\.layers\.0\.mlp\.router\.weight'"
    ):
        pack_tensors(moe_adapter_config(SMALL_MOE), tensors, tmp_path / "packed")


@pytest.mark.parametrize("damage", ["truncate", "alter", "delete"])
@pytest.mark.parametrize("check", [verify, load])
def test_damaged_shard_fails_verify_and_load_naming_it(
    tmp_path: Path, damage: str, check: object
) -> None:
    config, tensors = moe_adapter_config(SMALL_MOE), moe_lora_tensors(SMALL_MOE)
    index = pack_tensors(config, tensors, tmp_path / "packed", shard_bytes=8 << 10)
    shard = index.shards[len(index.shards) // 2].name
    path = tmp_path / "packed" / shard
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[:-1])
    elif damage == "alter":
        path.write_bytes(data[:-5] + bytes([data[-5] ^ 1]) + data[-4:])
    else:
        path.unlink()
    with pytest.raises(IntegrityError, match=shard):
        check(tmp_path / "packed")  # type: ignore[operator]


def test_packed_adapter_serves_exactly_like_its_peft_form(tmp_path: Path) -> None:
    spec = TinySpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                    pretrain_steps=20, pretrain_batch_size=8)  # fmt: skip
    source = BaseSource(str(ensure_tiny(spec, tmp_path / "home" / "base")))
    data, held_out = (
        parse_jsonl(path.read_bytes(), str(path))
        for path in (
            write_task_data(Task.REVERSE, tmp_path / "data", rows=160),
            write_held_out_data(Task.REVERSE, tmp_path / "data", count=8),
        )
    )
    trained = train_lora(source, tmp_path / "home", data, held_out, tmp_path / "peft",
                         TrainingConfig(steps=20, batch_size=8))  # fmt: skip
    base = load_base(source, tmp_path / "home")
    pack(freeze(trained.path, tmp_path / "frozen"), tmp_path / "packed")
    packed = load(tmp_path / "packed")

    engine = TorchEngine(base)
    engine.load(engine.prepare("packed", packed.index.adapter_config, packed.peft_state_dict()))
    config, tensors = read_adapter(trained.path)
    engine.load(engine.prepare("peft", config, tensors))
    prompts = [prompt_for(word) for word in held_out_words(16)]
    from_packed = engine.generate(prompts, ["packed"] * len(prompts), 12)
    from_peft = engine.generate(prompts, ["peft"] * len(prompts), 12)
    assert from_packed == from_peft
    # And the adapter does change the answers: the comparison is not of two base runs.
    assert engine.generate(prompts, ["__base__"] * len(prompts), 12) != from_packed


def test_chunked_read_checks_the_same_bytes_as_the_memory_map(tmp_path: Path) -> None:
    # The pinned-memory path (taken when CUDA is present) reads in chunks instead of mapping.
    index = pack_tensors(moe_adapter_config(SMALL_MOE), moe_lora_tensors(SMALL_MOE),
                         tmp_path / "packed", shard_bytes=8 << 10)  # fmt: skip
    for shard in index.shards:
        path = tmp_path / "packed" / shard.name
        buffer, hasher = torch.empty(shard.bytes, dtype=torch.uint8), xxhash.xxh3_128()
        read_into(path, buffer, hasher)
        assert hasher.hexdigest() == shard.xxh3
        mapped = map_file(path, xxhash.xxh3_128())
        assert torch.equal(buffer, mapped)
        mapped.zero_()  # copy-on-write: the file keeps its bytes
        assert path.read_bytes() == buffer.numpy().tobytes()


def fused_expert_adapter(folder: Path) -> tuple[PeftModel, dict[str, torch.Tensor]]:
    """A random LoRA on a tiny Qwen3-MoE's attention and fused experts, saved in `folder`."""
    model = Qwen3MoeForCausalLM(
        Qwen3MoeConfig(vocab_size=64, hidden_size=32, moe_intermediate_size=16,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, num_experts=4, num_experts_per_tok=2)
    )  # fmt: skip
    lora = LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj", "v_proj"],
                      target_parameters=["gate_up_proj", "mlp.experts.down_proj"])  # fmt: skip
    peft_model = random_lora(model, lora, seed=3, std=0.3)
    peft_model.save_pretrained(folder, save_embedding_layers=False)
    return peft_model, load_file(folder / PEFT_WEIGHTS)


def test_fused_expert_lora_is_stored_per_expert_and_round_trips_bit_exactly(
    tmp_path: Path,
) -> None:
    peft_model, tensors = fused_expert_adapter(tmp_path / "peft")
    index = pack(freeze(tmp_path / "peft", tmp_path / "frozen"), tmp_path / "packed")
    fused = {t.key: t for t in index.tensors.values() if t.fused is not None}
    assert len(fused) == 2 * 2 * 2  # layers x {gate_up_proj, down_proj} x {A, B}
    assert {(t.fused.experts, t.fused.rank) for t in fused.values()} == {(4, 2)}  # type: ignore[union-attr]
    loaded = load(tmp_path / "packed")
    gate_up = "base_model.model.model.layers.1.mlp.experts.base_layer"
    # gate_up_proj is [4 experts, 2*16, 32]: A [4, 2, 32] and B [32, 2, 4] on disk.
    assert loaded.tensors[f"{gate_up}.lora_A.weight"].shape == (4, 2, 32)
    assert loaded.tensors[f"{gate_up}.lora_B.weight"].shape == (32, 2, 4)
    assert_same_tensors(loaded.peft_state_dict(), tensors)
    assert verify(tmp_path / "packed") == index
    # The identity is the PEFT tensors', however they are stored.
    plain = pack_tensors({**index.adapter_config, "target_parameters": None}, tensors,
                         tmp_path / "plain")  # fmt: skip
    assert not any(t.fused for t in plain.tensors.values())
    assert plain.content_digest != index.content_digest  # the config differs, nothing else:
    assert (
        index.content_digest
        == pack_tensors(
            index.adapter_config, tensors, tmp_path / "again", shard_bytes=1 << 10
        ).content_digest
    )
    unpack(tmp_path / "packed", tmp_path / "unpacked")
    assert_same_tensors(load_file(tmp_path / "unpacked" / PEFT_WEIGHTS), tensors)

    # Per-expert stacks give PEFT's own delta of every expert.
    stacks = loaded.expert_stacks()
    assert len(stacks) == 4
    scaling = 6 / 2
    for layer in (0, 1):
        experts = peft_model.base_model.model.model.layers[layer].mlp.experts
        for wrapper, key in ((experts.base_layer, f"model.layers.{layer}.mlp.experts.base_layer"),
                             (experts, f"model.layers.{layer}.mlp.experts")):  # fmt: skip
            a, b = stacks[key]
            assert a.shape[:2] == b.shape[0:3:2] == (4, 2)
            expected = wrapper.get_delta_weight("default")
            torch.testing.assert_close(scaling * b @ a, expected, rtol=0, atol=1e-6)


def test_format_version_3_is_still_read(tmp_path: Path) -> None:
    config, tensors = moe_adapter_config(SMALL_MOE), moe_lora_tensors(SMALL_MOE)
    pack_tensors(config, tensors, tmp_path / "packed")
    path = tmp_path / "packed" / "index.json"
    raw = json.loads(path.read_text())
    assert raw["format_version"] == 4
    path.write_text(json.dumps(raw | {"format_version": 3}))
    assert_same_tensors(load(tmp_path / "packed").peft_state_dict(), tensors)
    path.write_text(json.dumps(raw | {"format_version": 2}))
    with pytest.raises(ConfigurationError, match=r"v2; this MinT reads 'mint-packed' v3/v4"):
        load(tmp_path / "packed")


def test_a_fused_expert_tensor_that_is_not_rank_x_experts_is_refused(tmp_path: Path) -> None:
    _, tensors = fused_expert_adapter(tmp_path / "peft")
    config = json.loads((tmp_path / "peft" / PEFT_CONFIG).read_text())
    with pytest.raises(
        ConfigurationError, match=r"experts\.gate_up_proj but has shape \[8, 32\], not rank 3"
    ):
        pack_tensors(config | {"r": 3}, tensors, tmp_path / "packed")
