"""Freeze, pack, verify and export on a real (tiny, briefly trained) PEFT adapter."""

import dataclasses
import hashlib
import stat
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mint_core.artifacts.freezing import PEFT_WEIGHTS, freeze
from mint_core.artifacts.packing import load, pack, verify
from mint_core.artifacts.stores import (
    ArtifactStore,
    LocalArtifactStore,
    S3ArtifactStore,
    open_store,
)
from mint_core.config import MintConfig
from mint_core.errors import ConfigurationError, IntegrityError, NotFoundError
from mint_core.model import toy
from mint_core.model.base import BaseSource, load_base
from mint_core.model.datasets import Dataset, parse_jsonl
from mint_core.model.tiny import TinySpec, ensure_tiny
from mint_core.model.training import TrainedAdapter, TrainingConfig, train_lora
from processes import ManagedProcess
from tests.integration.helpers import corrupt_in_place, create_bucket

TINY = TinySpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, pretrain_steps=0)


def tiny_source(spec: TinySpec, home: Path) -> BaseSource:
    """`spec`'s model folder, built under `home`, as MINT_BASE_MODEL would name it."""
    return BaseSource(str(ensure_tiny(spec, home / "base")))


def read(path: Path) -> Dataset:
    return parse_jsonl(path.read_bytes(), str(path))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> TrainedAdapter:
    home = tmp_path_factory.mktemp("home")
    data = read(toy.write_task_data(toy.Task.UPPER, home / "data", rows=32))
    held_out = read(toy.write_held_out_data(toy.Task.UPPER, home / "data", count=8))
    config = TrainingConfig(steps=3, batch_size=4)
    return train_lora(tiny_source(TINY, home), home, data, held_out, home / "adapter", config)


def test_base_is_deterministic_from_its_spec(tmp_path: Path) -> None:
    first = load_base(tiny_source(TINY, tmp_path / "a"), tmp_path / "a")
    second = load_base(tiny_source(TINY, tmp_path / "b"), tmp_path / "b")
    other = load_base(
        tiny_source(dataclasses.replace(TINY, seed=1), tmp_path / "c"), tmp_path / "c"
    )
    assert first.identity == second.identity
    assert first.digest != other.digest


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


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ArtifactStore:
    if request.param == "local":
        return LocalArtifactStore(tmp_path / "store")
    s3_server: ManagedProcess = request.getfixturevalue("s3_server")
    bucket = f"store-{uuid.uuid4().hex[:12]}"
    create_bucket(s3_server.url, bucket)
    return S3ArtifactStore(bucket, "mint", s3_server.url, tmp_path / "cache")


def test_store_is_content_addressed_and_keeps_good_copies(
    trained: TrainedAdapter, tmp_path: Path, store: ArtifactStore
) -> None:
    index = pack(freeze(trained.path, tmp_path / "frozen"), tmp_path / "packed")
    uri = store.put(tmp_path / "packed", index.content_digest)
    assert uri.endswith(f"sha256/{index.content_digest.removeprefix('sha256:')}")
    assert store.holds(uri)
    assert verify(store.fetch(uri)) == index
    assert store.put(tmp_path / "packed", index.content_digest) == uri

    # A corrupt source never replaces the good copy.
    shard = index.shards[0].name
    (tmp_path / "packed" / shard).write_bytes(b"garbage")
    assert store.put(tmp_path / "packed", index.content_digest) == uri
    assert verify(store.fetch(uri)) == index


def test_a_shard_damaged_in_place_is_seen_by_its_bytes_and_replaced_by_an_export(
    trained: TrainedAdapter, tmp_path: Path, store: ArtifactStore
) -> None:
    """A stored shard overwritten in place keeps its size and, in S3, its metadata (the sha256
    MinT recorded at upload): only its bytes tell. `holds` reads them, and exporting again
    (what `mint repair` does) replaces the damaged copy, so a fresh fetch verifies."""
    index = pack(freeze(trained.path, tmp_path / "frozen"), tmp_path / "packed")
    uri = store.put(tmp_path / "packed", index.content_digest)
    shard = index.shards[0]
    corrupt_in_place(store, uri, shard.name)
    if isinstance(store, S3ArtifactStore):
        head = store.s3.head_object(Bucket=store.bucket, Key=store.shard_key(shard.sha256))
        assert (head["ContentLength"], head["Metadata"]) == (shard.bytes, {"sha256": shard.sha256})
    assert not store.holds(uri)

    assert store.put(tmp_path / "packed", index.content_digest) == uri

    if isinstance(store, S3ArtifactStore):
        key = store.shard_key(shard.sha256)
        stored = store.s3.get_object(Bucket=store.bucket, Key=key)["Body"].read()
        # A worker with no copy of its own reads it from the bucket.
        store = S3ArtifactStore(store.bucket, store.prefix, store.s3.meta.endpoint_url,
                                tmp_path / "fresh-cache")  # fmt: skip
    else:
        stored = (store.fetch(uri) / shard.name).read_bytes()
    assert "sha256:" + hashlib.sha256(stored).hexdigest() == shard.sha256
    assert store.holds(uri)
    assert verify(store.fetch(uri)) == index


def test_corrupt_source_never_lands_in_an_empty_store(
    trained: TrainedAdapter, tmp_path: Path, store: ArtifactStore
) -> None:
    index = pack(freeze(trained.path, tmp_path / "frozen"), tmp_path / "packed")
    (tmp_path / "packed" / index.shards[0].name).write_bytes(b"garbage")
    with pytest.raises(IntegrityError, match=index.shards[0].name):
        store.put(tmp_path / "packed", index.content_digest)
    with pytest.raises(NotFoundError, match=r"re-export its revision \(mint repair\)"):
        store.fetch(uri_of(store, index.content_digest))


def uri_of(store: ArtifactStore, digest: str) -> str:
    hexdigest = digest.removeprefix("sha256:")
    if isinstance(store, S3ArtifactStore):
        return f"s3://{store.bucket}/{store.prefix}/revisions/sha256/{hexdigest}"
    return f"mint-local://sha256/{hexdigest}"


def test_s3_store_uploads_a_shard_once_and_verifies_every_read(
    trained: TrainedAdapter, tmp_path: Path, s3_server: ManagedProcess
) -> None:
    create_bucket(s3_server.url, "dedup")
    store = S3ArtifactStore("dedup", "team/mint", s3_server.url, tmp_path / "cache")
    uploads: list[str] = []
    store.s3.meta.events.register(
        "before-call.s3.PutObject", lambda params, **_: uploads.append(params["url_path"])
    )
    index = pack(freeze(trained.path, tmp_path / "frozen"), tmp_path / "packed", shard_bytes=4096)
    assert len(index.shards) > 1
    uri = store.put(tmp_path / "packed", index.content_digest)
    assert len(uploads) == len(index.shards) + 1  # every shard, then the index

    # With the index lost, exporting again writes only the index: the shards are there.
    store.s3.delete_object(Bucket="dedup", Key=store.index_key(index.content_digest))
    assert not store.holds(uri)
    uploads.clear()
    assert store.put(tmp_path / "packed", index.content_digest) == uri
    assert [path.rsplit("/", 1)[-1] for path in uploads] == ["index.json"]

    # A shard overwritten in the bucket is caught on download, named with its digest.
    shard = index.shards[1]
    store.s3.put_object(Bucket="dedup", Key=store.shard_key(shard.sha256), Body=b"x" * shard.bytes)
    assert not store.holds(uri)
    with pytest.raises(IntegrityError, match=f"{shard.name}.*{shard.sha256}"):
        store.fetch(uri)
    assert not (tmp_path / "cache" / "sha256" / index.content_digest[7:]).exists()
    # Exporting again repairs it (the damaged shard is uploaded again); reads succeed.
    store.put(tmp_path / "packed", index.content_digest)
    assert verify(store.fetch(uri)) == index


def test_store_errors_name_the_problem(tmp_path: Path, s3_server: ManagedProcess) -> None:
    store = LocalArtifactStore(tmp_path)
    with pytest.raises(NotFoundError, match="not in the store"):
        store.fetch("mint-local://sha256/" + "0" * 64)
    with pytest.raises(ConfigurationError, match="expected mint-local"):
        store.fetch("s3://bucket/x")
    with pytest.raises(ConfigurationError, match="known stores: local, s3"):
        open_store(MintConfig(artifact_store="ftp"))
    with pytest.raises(ConfigurationError, match="MINT_S3_BUCKET"):
        MintConfig(artifact_store="s3")
    s3 = S3ArtifactStore("nobucket", "mint", s3_server.url, tmp_path / "cache")
    with pytest.raises(ConfigurationError, match="expected s3://nobucket/mint/revisions/sha256/"):
        s3.fetch("mint-local://sha256/" + "0" * 64)
