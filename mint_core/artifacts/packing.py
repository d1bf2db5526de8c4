"""Pack: an adapter's many small tensors, stacked and packed into a few large shards.

A LoRA of a mixture-of-experts model has one A and one B tensor per layer x expert x
projection: tens of thousands of small tensors that load slowly one file or one key at a time.
Packing stacks each layer's per-expert tensors of one projection into a single `[experts, ...]`
tensor, writes the stacks into safetensors shards of bounded size in the order the loader reads
them, and records an index. Loading then reads a few large files sequentially, straight into
one buffer per shard, and hands out the stacked tensors as views: no per-tensor file opens, no
per-expert re-split. The format is specified in docs/packed-format.md.
"""

import json
import math
import mmap
import os
import re
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from safetensors.torch import load_file, save_file

from mint_core.artifacts.freezing import PEFT_CONFIG, PEFT_WEIGHTS, FrozenAdapter
from mint_core.artifacts.packed_index import (
    CORRUPT_ADVICE,
    DEFAULT_SHARD_BYTES,
    EXPERT_SLOT,
    INDEX,
    FusedExperts,
    PackedIndex,
    Shard,
    StoredTensor,
    TensorContent,
    checked_shard_path,
    content_digest,
    is_lora_a,
    safetensors_header,
    sha256_of,
    verify,
)
from mint_core.errors import ConfigurationError, IntegrityError
from mint_core.model.experts import expert_rank, expert_stacks, fused_expert_parameter

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "INDEX",
    "FusedExperts",
    "PackedAdapter",
    "PackedIndex",
    "StoredTensor",
    "check_keys",
    "load",
    "map_file",
    "pack",
    "pack_tensors",
    "read_adapter",
    "read_into",
    "unpack",
    "verify",
    "write_peft",
]
"""The index's names are here too (from `mint_core.artifacts.packed_index`): one import for
packing."""

_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
_PER_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<projection>\w+)$")
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


def _content(key: str, tensor: torch.Tensor) -> TensorContent:
    dtype = _DTYPE_NAMES.get(tensor.dtype)
    if dtype is None:
        raise ConfigurationError(
            f"tensor {key!r} has dtype {tensor.dtype}, which the packed format does not hold; "
            f"save the adapter in one of: {', '.join(map(str, _DTYPES.values()))}"
        )
    data = memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
    return TensorContent(key, dtype, tuple(tensor.shape), sha256_of(data))


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
    stacked = tensor.shape[0 if is_lora_a(key) else 1] if tensor.dim() == 2 else 0
    if not stacked or stacked % rank:
        raise ConfigurationError(
            f"{key!r} adapts the fused experts {'.'.join(target)} but has shape "
            f"{list(tensor.shape)}, not rank {rank} (the adapter config's) x experts; the "
            "weights and adapter_config.json do not belong together"
        )
    return FusedExperts(stacked // rank, rank)


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
        templates[stored] = key.replace(f".experts.{expert['expert']}.", f".experts.{EXPERT_SLOT}.")
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
        shards.append(Shard(name, len(data), sha256_of(data), xxhash.xxh3_128_hexdigest(data)))
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
            sides.setdefault(module, {})[is_lora_a(stored.key)] = stored.as_peft(self.tensors[name])
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
    path = checked_shard_path(folder, shard)
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
            f"{CORRUPT_ADVICE}"
        )
    start, header = safetensors_header(memoryview(buffer.numpy()))
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
