"""A packed adapter's index (`index.json`) and its verification, without loading any tensor
library: what the artifact stores, the catalog and the gateway need of the packed format.
`mint_core.artifacts.packing` writes and loads the tensors themselves. The format is specified in
docs/packed-format.md.
"""

import hashlib
import json
import mmap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

from mint_core.artifacts.digests import sha256_json
from mint_core.errors import ConfigurationError, IntegrityError

if TYPE_CHECKING:
    import torch

FORMAT = "mint-packed"
FORMAT_VERSION = 4
READABLE_VERSIONS = (3, 4)
"""Version 3 is version 4 without fused expert tensors (`fused` absent: none)."""
INDEX = "index.json"
DEFAULT_SHARD_BYTES = 32 << 20
"""The size a shard is filled to unless a caller asks for another. Defined with the format, not
the packer: shipping passes it on, and a promotion or rollback, which imports shipping but
re-packs only a lost artifact, loads no tensor library."""
EXPERT_SLOT = "{expert}"
"""Where the expert number goes in the PEFT key template of a stack of per-expert tensors."""
CORRUPT_ADVICE = (
    "the artifact is corrupt; export the revision again from its frozen files "
    "(mint repair --adapter NAME --revision N)"
)


@dataclass(frozen=True)
class FusedExperts:
    """How a fused expert LoRA tensor (PEFT's `target_parameters`: A `[rank*experts, in]`,
    B `[out, rank*experts]`) is stored: reshaped to A `[experts, rank, in]`, B
    `[out, rank, experts]`, which keeps PEFT's bytes as they are (`mint_core.model.experts`)."""

    experts: int
    rank: int

    def peft_shape(self, stored: tuple[int, ...], key: str) -> tuple[int, ...]:
        if is_lora_a(key):
            return (stored[0] * stored[1], stored[2])
        return (stored[0], stored[1] * stored[2])

    def stored_shape(self, peft: tuple[int, ...], key: str) -> tuple[int, ...]:
        if is_lora_a(key):
            return (self.experts, self.rank, peft[1])
        return (peft[0], self.rank, self.experts)


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as it lies in a shard: a PEFT tensor, a stack of per-expert ones, or a fused
    expert tensor reshaped per expert."""

    shard: str
    key: str
    """The PEFT key; for a stack, a template with `{expert}` where the expert number goes."""
    experts: tuple[int, ...] | None = None
    """For a stack: the expert number at each position of dimension 0."""
    fused: FusedExperts | None = None
    """For a fused expert tensor: its experts and rank."""

    def as_peft(self, tensor: "torch.Tensor") -> "torch.Tensor":
        """The stored (non-stack) `tensor` in PEFT's shape: a view, bytes untouched."""
        if self.fused is None:
            return tensor
        return tensor.reshape(self.fused.peft_shape(tuple(tensor.shape), self.key))


@dataclass(frozen=True)
class Shard:
    name: str
    bytes: int
    sha256: str
    """Identity of the bytes; checked by `verify` (on fetch, export, unpack)."""
    xxh3: str
    """A fast checksum (xxh3-128) checked on every `load`, at memory speed."""


@dataclass(frozen=True)
class PackedIndex:
    """The parsed `index.json` of a packed adapter."""

    adapter_config: dict[str, object]
    tensors: dict[str, StoredTensor]
    """Stored name -> where it lies and which PEFT keys it holds, in reading order."""
    shards: tuple[Shard, ...]
    content_digest: str

    def peft_keys(self) -> dict[str, tuple[str, int | None]]:
        """Every original PEFT key -> (stored tensor name, expert position or None)."""
        keys: dict[str, tuple[str, int | None]] = {}
        for name, stored in self.tensors.items():
            if stored.experts is None:
                keys[stored.key] = (name, None)
            else:
                for position, expert in enumerate(stored.experts):
                    keys[stored.key.replace(EXPERT_SLOT, str(expert))] = (name, position)
        return keys

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "adapter_config": self.adapter_config,
                "tensors": {
                    name: {"shard": t.shard, "key": t.key, "experts": _encode_experts(t.experts)}
                    | ({"fused": vars(t.fused)} if t.fused else {})
                    for name, t in self.tensors.items()
                },
                "shards": [vars(shard) for shard in self.shards],
                "content_digest": self.content_digest,
            },
            indent=1,
        )

    @classmethod
    def read(cls, folder: Path) -> "PackedIndex":
        path = folder / INDEX
        if not path.is_file():
            raise IntegrityError(f"packed adapter {folder} has no {INDEX}; pack or export it again")
        raw = orjson.loads(path.read_bytes())
        if raw.get("format") != FORMAT or raw.get("format_version") not in READABLE_VERSIONS:
            raise ConfigurationError(
                f"{path} is format {raw.get('format')!r} v{raw.get('format_version')!r}; this "
                f"MinT reads {FORMAT!r} v{'/v'.join(map(str, READABLE_VERSIONS))}: pack the "
                "adapter again"
            )
        tensors = {
            name: StoredTensor(
                t["shard"],
                t["key"],
                _decode_experts(t["experts"]),
                FusedExperts(**t["fused"]) if t.get("fused") else None,
            )
            for name, t in raw["tensors"].items()
        }
        shards = tuple(Shard(**shard) for shard in raw["shards"])
        return cls(raw["adapter_config"], tensors, shards, raw["content_digest"])


def _encode_experts(experts: tuple[int, ...] | None) -> object:
    """A contiguous run of experts (the usual case) as {first, count}, keeping the index small."""
    if experts and experts == tuple(range(experts[0], experts[0] + len(experts))):
        return {"first": experts[0], "count": len(experts)}
    return list(experts) if experts is not None else None


def _decode_experts(raw: object) -> tuple[int, ...] | None:
    if raw is None:
        return None
    if isinstance(raw, dict):
        return tuple(range(raw["first"], raw["first"] + raw["count"]))
    return tuple(raw)  # type: ignore[arg-type]


@dataclass(frozen=True)
class TensorContent:
    """One PEFT tensor as the content digest sees it."""

    key: str
    dtype: str
    """Its safetensors dtype name, e.g. `BF16`."""
    shape: tuple[int, ...]
    sha256: str
    """Of its bytes, row-major and little-endian, as safetensors stores them."""


def content_digest(adapter_config: Mapping[str, object], tensors: Iterable[TensorContent]) -> str:
    """A revision's identity: sha256 over the canonical adapter config and every PEFT tensor's
    key, dtype, shape and sha256, in key order. It names what the adapter is, not how it is
    packed: shard size, stacking and format version leave it unchanged, so any packer can
    export a revision again under the identity it was registered with."""
    entries = sorted([t.key, t.dtype, list(t.shape), t.sha256] for t in tensors)
    return sha256_json({"config": adapter_config, "tensors": entries})


def is_lora_a(key: str) -> bool:
    return key.endswith(".lora_A.weight")


def sha256_of(data: bytes | memoryview) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def verify(folder: Path) -> PackedIndex:
    """The index, once every shard exists with its size and sha256 and the tensors they hold
    give the index's content digest; IntegrityError naming the shard or the digests otherwise.
    Cryptographic: for the trust boundary (export, fetch), not every load."""
    index = PackedIndex.read(folder)
    by_shard: dict[str, dict[str, StoredTensor]] = {}
    for name, stored in index.tensors.items():
        by_shard.setdefault(stored.shard, {})[name] = stored
    contents: list[TensorContent] = []
    for shard in index.shards:
        path = checked_shard_path(folder, shard)
        with (
            open(path, "rb") as stream,
            mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ) as mapped,
            memoryview(mapped) as data,
        ):
            actual = sha256_of(data)
            if actual != shard.sha256:
                raise IntegrityError(
                    f"shard {shard.name} of {folder} has sha256 {actual}, the index says "
                    f"{shard.sha256}: {CORRUPT_ADVICE}"
                )
            contents += _shard_contents(data, shard, by_shard.get(shard.name, {}))
    actual = content_digest(index.adapter_config, contents)
    if actual != index.content_digest:
        raise IntegrityError(
            f"the tensors of {folder} have content digest {actual}, its index says "
            f"{index.content_digest}: {CORRUPT_ADVICE}"
        )
    return index


def _shard_contents(
    data: memoryview, shard: Shard, stored: Mapping[str, StoredTensor]
) -> list[TensorContent]:
    """The content of every PEFT tensor the index puts in this shard, from the shard's bytes: a
    stack's experts are consecutive equal slices of it."""
    start, header = safetensors_header(data)
    contents = []
    for name, tensor in stored.items():
        meta = header.get(name)
        if meta is None:
            raise IntegrityError(f"shard {shard.name} lacks tensor {name}: {CORRUPT_ADVICE}")
        begin, end = (start + offset for offset in meta["data_offsets"])
        shape = tuple(meta["shape"])
        if tensor.experts is None:
            if tensor.fused is not None:  # the same bytes as PEFT's tensor, in its shape
                shape = tensor.fused.peft_shape(shape, tensor.key)
            contents.append(
                TensorContent(tensor.key, meta["dtype"], shape, sha256_of(data[begin:end]))
            )
            continue
        step = (end - begin) // len(tensor.experts)
        for position, expert in enumerate(tensor.experts):
            piece = data[begin + position * step : begin + (position + 1) * step]
            key = tensor.key.replace(EXPERT_SLOT, str(expert))
            contents.append(TensorContent(key, meta["dtype"], shape[1:], sha256_of(piece)))
    return contents


def safetensors_header(data: memoryview) -> tuple[int, dict[str, dict]]:
    """A safetensors file's header without its metadata, and where its data area begins."""
    length = int.from_bytes(bytes(data[:8]), "little")
    header = orjson.loads(bytes(data[8 : 8 + length]))
    header.pop("__metadata__", None)
    return 8 + length, header


def checked_shard_path(folder: Path, shard: Shard) -> Path:
    path = folder / shard.name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise IntegrityError(f"shard {shard.name} of {folder} is missing") from None
    if size != shard.bytes:
        raise IntegrityError(
            f"shard {shard.name} of {folder} is {size} bytes, the index says {shard.bytes}: "
            f"it is truncated or overwritten; {CORRUPT_ADVICE}"
        )
    return path
