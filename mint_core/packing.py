"""Pack: an adapter's many small tensors, stacked and packed into a few large shards.

A LoRA of a mixture-of-experts model has one A and one B tensor per layer x expert x
projection: tens of thousands of small tensors that load slowly one file or one key at a time.
Packing stacks each layer's per-expert tensors of one projection into a single `[experts, ...]`
tensor, writes the stacks into safetensors shards of bounded size in the order the loader reads
them, and records an index. Loading then reads a few large files sequentially, straight into
one buffer per shard, and hands out the stacked tensors as views: no per-tensor file opens, no
per-expert re-split. The format is specified in docs/packed-format.md.
"""

import hashlib
import json
import math
import mmap
import os
import re
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import orjson
import torch
import xxhash
from safetensors.torch import load_file, save_file

from mint_core.digests import sha256_json
from mint_core.errors import ConfigurationError, IntegrityError
from mint_core.freezing import PEFT_CONFIG, PEFT_WEIGHTS, FrozenAdapter
from mint_core.model.experts import expert_rank, expert_stacks, fused_expert_parameter

FORMAT = "mint-packed"
FORMAT_VERSION = 4
READABLE_VERSIONS = (3, 4)
"""Version 3 is version 4 without fused expert tensors (`fused` absent: none)."""
INDEX = "index.json"
DEFAULT_SHARD_BYTES = 32 << 20

_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
_PER_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<projection>\w+)$")
_EXPERT_SLOT = "{expert}"
_PEFT_PREFIX = "base_model.model."
_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I8": torch.int8,
    "U8": torch.uint8,
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_CORRUPT = (
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
        if _is_lora_a(key):
            return (stored[0] * stored[1], stored[2])
        return (stored[0], stored[1] * stored[2])

    def stored_shape(self, peft: tuple[int, ...], key: str) -> tuple[int, ...]:
        if _is_lora_a(key):
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

    def as_peft(self, tensor: torch.Tensor) -> torch.Tensor:
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
                    keys[stored.key.replace(_EXPERT_SLOT, str(expert))] = (name, position)
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


def _content(key: str, tensor: torch.Tensor) -> TensorContent:
    dtype = _DTYPE_NAMES.get(tensor.dtype)
    if dtype is None:
        raise ConfigurationError(
            f"tensor {key!r} has dtype {tensor.dtype}, which the packed format does not hold; "
            f"save the adapter in one of: {', '.join(map(str, _DTYPES.values()))}"
        )
    data = memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
    return TensorContent(key, dtype, tuple(tensor.shape), _sha256(data))


def _is_lora_a(key: str) -> bool:
    return key.endswith(".lora_A.weight")


def _fused(
    adapter_config: Mapping[str, object], key: str, tensor: torch.Tensor
) -> FusedExperts | None:
    """How `key` is stored if it is a fused expert LoRA tensor; None if it is not one."""
    lora = _LORA_KEY.match(key)
    module = lora["module"].removeprefix(_PEFT_PREFIX) if lora else ""
    target = fused_expert_parameter(module, adapter_config.get("target_parameters"))  # type: ignore[arg-type]
    if target is None:
        return None
    rank = expert_rank(adapter_config, *target)
    stacked = tensor.shape[0 if _is_lora_a(key) else 1] if tensor.dim() == 2 else 0
    if not stacked or stacked % rank:
        raise ConfigurationError(
            f"{key!r} adapts the fused experts {'.'.join(target)} but has shape "
            f"{list(tensor.shape)}, not rank {rank} (the adapter config's) x experts; the "
            "weights and adapter_config.json do not belong together"
        )
    return FusedExperts(stacked // rank, rank)


def _sha256(data: bytes | memoryview) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------- input layouts


def read_adapter(folder: Path) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    """An adapter's config and tensors from PEFT's layout (`adapter_model.safetensors`, per-expert
    or fused experts) or from a directory of one safetensors file per tensor."""
    config_path = folder / PEFT_CONFIG
    if not config_path.is_file():
        raise ConfigurationError(f"{folder} has no {PEFT_CONFIG}; pass a PEFT adapter folder")
    config = json.loads(config_path.read_text())
    if (folder / PEFT_WEIGHTS).is_file():
        tensors = load_file(folder / PEFT_WEIGHTS)
    else:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ConfigurationError(
                f"{folder} has neither {PEFT_WEIGHTS} nor per-tensor .safetensors files"
            )
        tensors = {}
        for path in files:
            tensors.update(load_file(path))
    check_keys(tensors)
    return config, tensors


def check_keys(keys: Iterable[str]) -> None:
    """Refuse any key that is not a LoRA A or B weight, naming it."""
    for key in keys:
        if not _LORA_KEY.match(key):
            raise ConfigurationError(
                f"unexpected tensor {key!r}: a packable adapter holds only LoRA weights named "
                "'<module>.lora_A.weight' or '<module>.lora_B.weight' (PEFT's layout)"
            )


# ---------------------------------------------------------------------------- packing


def _natural(text: str) -> list[object]:
    """Sort key that orders `layers.10` after `layers.9`: the order a loader walks the model."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _stack_plan(
    tensors: Mapping[str, torch.Tensor],
) -> dict[str, tuple[str, list[tuple[int, str]]]]:
    """Stored name -> (key or key template, [(expert, PEFT key)]); experts stack only when all
    members share shape and dtype."""
    groups: dict[str, list[tuple[int, str]]] = {}
    templates: dict[str, str] = {}
    for key in tensors:
        lora = _LORA_KEY.match(key)
        expert = _PER_EXPERT.match(lora["module"]) if lora else None
        if expert is None:
            groups[key] = [(-1, key)]
            templates[key] = key
            continue
        stored = f"{expert['experts']}.{expert['projection']}.lora_{lora['ab']}.stacked"  # type: ignore[index]
        groups.setdefault(stored, []).append((int(expert["expert"]), key))
        templates[stored] = key.replace(
            f".experts.{expert['expert']}.", f".experts.{_EXPERT_SLOT}."
        )
    plan: dict[str, tuple[str, list[tuple[int, str]]]] = {}
    for stored, members in groups.items():
        members.sort()
        first = tensors[members[0][1]]
        uniform = all(
            tensors[k].shape == first.shape and tensors[k].dtype == first.dtype for _, k in members
        )
        if members[0][0] >= 0 and uniform:
            plan[stored] = (templates[stored], members)
        else:
            for _, key in members:
                plan[key] = (key, [(-1, key)])
    return plan


def pack_tensors(
    adapter_config: dict[str, object],
    tensors: Mapping[str, torch.Tensor],
    out_dir: Path,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> PackedIndex:
    """Stack, shard and index `tensors` (PEFT keys) into `out_dir`, replacing any earlier
    pack there (its shards would otherwise linger beside these)."""
    if shard_bytes <= 0:
        raise ConfigurationError(f"shard_bytes={shard_bytes} must be > 0")
    check_keys(tensors)
    out_dir.mkdir(parents=True, exist_ok=True)
    for earlier in [out_dir / INDEX, *out_dir.glob("shard-*.safetensors")]:
        earlier.unlink(missing_ok=True)
    plan = _stack_plan(tensors)
    stored_tensors: dict[str, StoredTensor] = {}
    shards: list[Shard] = []
    group: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal group, size
        name = f"shard-{len(shards):05d}.safetensors"
        path = out_dir / name
        save_file(group, path)
        data = path.read_bytes()
        shards.append(Shard(name, len(data), _sha256(data), xxhash.xxh3_128_hexdigest(data)))
        group, size = {}, 0

    for stored in sorted(plan, key=_natural):
        key, members = plan[stored]
        fused = None
        if members[0][0] < 0:
            tensor = tensors[key].contiguous()
            experts = None
            if fused := _fused(adapter_config, key, tensor):
                tensor = tensor.reshape(fused.stored_shape(tuple(tensor.shape), key))
        else:
            tensor = torch.stack([tensors[k] for _, k in members])
            experts = tuple(expert for expert, _ in members)
        nbytes = tensor.numel() * tensor.element_size()
        if group and size + nbytes > shard_bytes:
            flush()
        group[stored] = tensor
        size += nbytes
        stored_tensors[stored] = StoredTensor(
            f"shard-{len(shards):05d}.safetensors", key, experts, fused
        )
    if group or not shards:
        flush()
    contents = (_content(key, tensor) for key, tensor in tensors.items())
    index = PackedIndex(
        adapter_config, stored_tensors, tuple(shards), content_digest(adapter_config, contents)
    )
    (out_dir / INDEX).write_text(index.to_json())
    return index


def pack(
    frozen: FrozenAdapter, out_dir: Path, shard_bytes: int = DEFAULT_SHARD_BYTES
) -> PackedIndex:
    """Pack a frozen PEFT adapter."""
    config, tensors = read_adapter(frozen.path)
    return pack_tensors(config, tensors, out_dir, shard_bytes)


# ---------------------------------------------------------------------------- reading


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
        path = _checked_path(folder, shard)
        with (
            open(path, "rb") as stream,
            mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ) as mapped,
            memoryview(mapped) as data,
        ):
            actual = _sha256(data)
            if actual != shard.sha256:
                raise IntegrityError(
                    f"shard {shard.name} of {folder} has sha256 {actual}, the index says "
                    f"{shard.sha256}: {_CORRUPT}"
                )
            contents += _shard_contents(data, shard, by_shard.get(shard.name, {}))
    actual = content_digest(index.adapter_config, contents)
    if actual != index.content_digest:
        raise IntegrityError(
            f"the tensors of {folder} have content digest {actual}, its index says "
            f"{index.content_digest}: {_CORRUPT}"
        )
    return index


def _shard_contents(
    data: memoryview, shard: Shard, stored: Mapping[str, StoredTensor]
) -> list[TensorContent]:
    """The content of every PEFT tensor the index puts in this shard, from the shard's bytes: a
    stack's experts are consecutive equal slices of it."""
    start, header = _header(data)
    contents = []
    for name, tensor in stored.items():
        meta = header.get(name)
        if meta is None:
            raise IntegrityError(f"shard {shard.name} lacks tensor {name}: {_CORRUPT}")
        begin, end = (start + offset for offset in meta["data_offsets"])
        shape = tuple(meta["shape"])
        if tensor.experts is None:
            if tensor.fused is not None:  # the same bytes as PEFT's tensor, in its shape
                shape = tensor.fused.peft_shape(shape, tensor.key)
            contents.append(
                TensorContent(tensor.key, meta["dtype"], shape, _sha256(data[begin:end]))
            )
            continue
        step = (end - begin) // len(tensor.experts)
        for position, expert in enumerate(tensor.experts):
            piece = data[begin + position * step : begin + (position + 1) * step]
            key = tensor.key.replace(_EXPERT_SLOT, str(expert))
            contents.append(TensorContent(key, meta["dtype"], shape[1:], _sha256(piece)))
    return contents


def _header(data: memoryview) -> tuple[int, dict[str, dict]]:
    """A safetensors file's header without its metadata, and where its data area begins."""
    length = int.from_bytes(bytes(data[:8]), "little")
    header = orjson.loads(bytes(data[8 : 8 + length]))
    header.pop("__metadata__", None)
    return 8 + length, header


def _checked_path(folder: Path, shard: Shard) -> Path:
    path = folder / shard.name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise IntegrityError(f"shard {shard.name} of {folder} is missing") from None
    if size != shard.bytes:
        raise IntegrityError(
            f"shard {shard.name} of {folder} is {size} bytes, the index says {shard.bytes}: "
            f"it is truncated or overwritten; {_CORRUPT}"
        )
    return path


@dataclass(frozen=True)
class PackedAdapter:
    """A loaded packed adapter: stored tensors (stacks included) as views into shard buffers."""

    index: PackedIndex
    tensors: dict[str, torch.Tensor]

    def peft_state_dict(self) -> dict[str, torch.Tensor]:
        """Every PEFT key -> its tensor, as views of the stacks (no copies)."""
        return {
            key: self.index.tensors[stored].as_peft(self.tensors[stored])
            if position is None
            else self.tensors[stored][position]
            for key, (stored, position) in self.index.peft_keys().items()
        }

    def expert_stacks(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Each fused expert LoRA pair per expert, by PEFT module key without
        `base_model.model.` (as `mint_core.model.experts.expert_lora_targets` keys them):
        (A `[experts, rank, in]`, B `[experts, out, rank]`), views of the shards."""
        sides: dict[str, dict[bool, torch.Tensor]] = {}
        experts: dict[str, int] = {}
        for name, stored in self.index.tensors.items():
            if stored.fused is None:
                continue
            module = stored.key.rpartition(".lora_")[0].removeprefix(_PEFT_PREFIX)
            sides.setdefault(module, {})[_is_lora_a(stored.key)] = stored.as_peft(
                self.tensors[name]
            )
            experts[module] = stored.fused.experts
        stacks = {}
        for module, pair in sides.items():
            if pair.keys() != {True, False}:
                raise IntegrityError(f"the fused experts {module} lack a lora_A or a lora_B")
            stacks[module] = expert_stacks(pair[True], pair[False], experts[module])
        return stacks


# Hash in pieces small enough to still be in the L2 cache right after they are read.
_READ_CHUNK = 1 << 19


def read_into(path: Path, buffer: torch.Tensor, hasher: "xxhash.xxh3_128 | None" = None) -> None:
    """Fill `buffer` (uint8, sized to the file) with the file's bytes in one sequential pass,
    feeding each chunk to `hasher` while it is still in the CPU cache."""
    view = memoryview(buffer.numpy()).cast("B")
    chunk = len(view) if hasher is None else _READ_CHUNK
    with open(path, "rb", buffering=0) as stream:
        filled = 0
        while filled < len(view):
            count = stream.readinto(view[filled : filled + chunk])
            if not count:
                raise IntegrityError(f"{path} ended after {filled} of {len(view)} bytes")
            if hasher is not None:
                hasher.update(view[filled : filled + count])
            filled += count


def map_file(path: Path, hasher: "xxhash.xxh3_128") -> torch.Tensor:
    """The file's bytes as a uint8 tensor over a private memory map, every page read once
    through `hasher`. Copy-on-write, so nothing written to the tensor reaches the file."""
    with open(path, "rb") as stream:
        mapped = mmap.mmap(stream.fileno(), 0, flags=mmap.MAP_PRIVATE)
    mapped.madvise(mmap.MADV_SEQUENTIAL)
    hasher.update(mapped)
    return torch.frombuffer(mapped, dtype=torch.uint8)


def _load_shard(folder: Path, shard: Shard, pin_memory: bool) -> dict[str, torch.Tensor]:
    path = _checked_path(folder, shard)
    hasher = xxhash.xxh3_128()
    if pin_memory:
        # Pinned host memory lets the copy into a device slot run asynchronously.
        buffer = torch.empty(shard.bytes, dtype=torch.uint8, pin_memory=True)
        read_into(path, buffer, hasher)
    else:
        # Without a device the map is the memory: no copy out of the page cache at all.
        buffer = map_file(path, hasher)
    if hasher.hexdigest() != shard.xxh3:
        raise IntegrityError(
            f"shard {shard.name} of {folder} does not match its checksum (xxh3 {shard.xxh3}): "
            f"{_CORRUPT}"
        )
    start, header = _header(memoryview(buffer.numpy()))
    return _views(buffer, start, header)


def _views(buffer: torch.Tensor, start: int, header: dict[str, dict]) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors header as a view into `buffer`, whose data area begins at
    `start`: one typed view of the data area per dtype, then one strided window per tensor
    (safetensors aligns every tensor to its dtype, so offsets divide evenly)."""
    windows: dict[str, torch.Tensor] = {}
    strides_of: dict[tuple[int, ...], tuple[int, ...]] = {}
    tensors = {}
    for name, meta in header.items():
        window = windows.get(meta["dtype"])
        if window is None:
            dtype = _DTYPES[meta["dtype"]]
            usable = (buffer.numel() - start) // dtype.itemsize * dtype.itemsize
            window = windows[meta["dtype"]] = buffer[start : start + usable].view(dtype)
        shape = tuple(meta["shape"])
        strides = strides_of.get(shape)
        if strides is None:  # a few distinct shapes per shard: compute each once
            strides = strides_of[shape] = tuple(
                math.prod(shape[axis + 1 :]) for axis in range(len(shape))
            )
        offset = window.storage_offset() + meta["data_offsets"][0] // window.itemsize
        tensors[name] = window.as_strided(shape, strides, offset)
    return tensors


def load(
    folder: Path, *, threads: int | None = None, pin_memory: bool | None = None
) -> PackedAdapter:
    """Read a packed adapter into memory, ready for the engine.

    Each shard is read whole into one buffer (pinned when CUDA is present, so the copy to a
    device slot is asynchronous), checked against its fast checksum, and cut into views; shards
    are read in parallel. Any missing, truncated or altered shard raises IntegrityError naming
    it, and nothing partial is returned."""
    index = PackedIndex.read(folder)
    pin = torch.cuda.is_available() if pin_memory is None else pin_memory
    workers = max(1, min(len(index.shards), threads or os.cpu_count() or 1))
    if workers == 1:
        parts = [_load_shard(folder, shard, pin) for shard in index.shards]
    else:
        with ThreadPoolExecutor(workers) as pool:
            parts = list(pool.map(lambda s: _load_shard(folder, s, pin), index.shards))
    tensors: dict[str, torch.Tensor] = {}
    for part in parts:
        tensors.update(part)
    missing = sorted(set(index.tensors) - set(tensors))
    if missing:
        raise IntegrityError(f"packed adapter {folder} lacks stored tensors {missing[:3]}")
    return PackedAdapter(index, tensors)


def unpack(folder: Path, out_dir: Path) -> Path:
    """Restore the exact PEFT layout: same keys, bit-identical tensors, same adapter config."""
    verify(folder)
    return write_peft(load(folder), out_dir)


def write_peft(adapter: PackedAdapter, out_dir: Path) -> Path:
    """`adapter` in PEFT's layout (what PEFT and vLLM load) in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {key: tensor.contiguous() for key, tensor in adapter.peft_state_dict().items()}
    save_file(tensors, out_dir / PEFT_WEIGHTS, metadata={"format": "pt"})
    (out_dir / PEFT_CONFIG).write_text(
        json.dumps(adapter.index.adapter_config, indent=2, sort_keys=True)
    )
    return out_dir
