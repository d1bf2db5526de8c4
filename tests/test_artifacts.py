"""Freeze, pack, verify and export on a real (tiny, briefly trained) PEFT adapter."""

import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mint_core.artifact_store import LocalArtifactStore, open_store
from mint_core.base_model import BaseModelSpec, load_base
from mint_core.datasets import Task
from mint_core.errors import ConfigurationError, IntegrityError, NotFoundError
from mint_core.freezing import PEFT_WEIGHTS, freeze
from mint_core.packing import load, pack, verify
from mint_core.training import TrainedAdapter, TrainingConfig, train_lora

TINY = BaseModelSpec(
    hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, pretrain_steps=0
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> TrainedAdapter:
    home = tmp_path_factory.mktemp("home")
    base = load_base(TINY, home)
    return train_lora(base, Task.UPPER, home / "adapter", TrainingConfig(steps=3, batch_size=4))


def test_base_is_deterministic_from_its_spec(tmp_path: Path) -> None:
    first = load_base(TINY, tmp_path / "a")
    second = load_base(TINY, tmp_path / "b")
    other = load_base(BaseModelSpec(**{**TINY.__dict__, "seed": 1}), tmp_path / "c")
    assert first.digest == second.digest != other.digest


def test_freeze_is_read_only_and_content_addressed(trained: TrainedAdapter, tmp_path: Path) -> None:
    frozen = freeze(trained.path, tmp_path / "frozen")
    assert frozen.path.name == frozen.digest.removeprefix("sha256:")
    for item in frozen.path.iterdir():
        assert not item.stat().st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)
    assert freeze(trained.path, tmp_path / "frozen") == frozen


def test_freeze_refuses_a_folder_that_is_not_a_peft_adapter(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"adapter_model\.safetensors"):
        freeze(tmp_path, tmp_path / "frozen")


@pytest.mark.parametrize("shard_bytes", [64 << 20, 4096])
def test_pack_then_load_is_bit_identical(
    trained: TrainedAdapter, tmp_path: Path, shard_bytes: int
) -> None:
    frozen = freeze(trained.path, tmp_path / "frozen")
    index = pack(frozen, tmp_path / "packed", shard_bytes=shard_bytes)
    original = load_file(trained.path / PEFT_WEIGHTS)
    loaded = load(tmp_path / "packed")
    tensors = loaded.peft_state_dict()
    assert loaded.index == index
    assert index.adapter_config == frozen.adapter_config
    assert tensors.keys() == original.keys()
    for key, tensor in original.items():
        assert torch.equal(tensors[key], tensor), key
    if shard_bytes == 4096:
        assert len(index.shards) > 1
    # Same bytes in, same content digest out.
    assert pack(frozen, tmp_path / "again", shard_bytes=shard_bytes).content_digest == (
        index.content_digest
    )


@pytest.mark.parametrize("damage", ["truncate", "alter", "delete"])
def test_damaged_shard_fails_verify_naming_it(
    trained: TrainedAdapter, tmp_path: Path, damage: str
) -> None:
    index = pack(freeze(trained.path, tmp_path / "frozen"), tmp_path / "packed", shard_bytes=4096)
    shard = index.shards[1].name
    path = tmp_path / "packed" / shard
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:-10])
    elif damage == "alter":
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        path.unlink()
    with pytest.raises(IntegrityError, match=shard):
        load(tmp_path / "packed")


def test_store_is_content_addressed_and_keeps_good_copies(
    trained: TrainedAdapter, tmp_path: Path
) -> None:
    index = pack(freeze(trained.path, tmp_path / "frozen"), tmp_path / "packed")
    store = open_store("local", tmp_path / "store")
    uri = store.put(tmp_path / "packed", index.content_digest)
    assert uri == f"mint-local://sha256/{index.content_digest.removeprefix('sha256:')}"
    assert verify(store.fetch(uri)) == index
    assert store.put(tmp_path / "packed", index.content_digest) == uri

    # A corrupt source never replaces the good copy, and never lands in an empty store.
    shard = index.shards[0].name
    (tmp_path / "packed" / shard).write_bytes(b"garbage")
    assert store.put(tmp_path / "packed", index.content_digest) == uri
    assert verify(store.fetch(uri)) == index
    empty = LocalArtifactStore(tmp_path / "store2")
    with pytest.raises(IntegrityError, match=shard):
        empty.put(tmp_path / "packed", index.content_digest)
    assert list((tmp_path / "store2" / "sha256").iterdir()) == []


def test_store_errors_name_the_problem(tmp_path: Path) -> None:
    store = open_store("local", tmp_path)
    with pytest.raises(NotFoundError, match="not in the store"):
        store.fetch("mint-local://sha256/" + "0" * 64)
    with pytest.raises(ConfigurationError, match="expected mint-local"):
        store.fetch("s3://bucket/x")
    with pytest.raises(ConfigurationError, match="known stores: local"):
        open_store("ftp", tmp_path)
