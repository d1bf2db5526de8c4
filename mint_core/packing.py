"""Pack: the adapter's tensors in safetensors shards plus an index, the layout workers load.

Format `mint-packed` v1 (kept deliberately simple here): shards of bounded size holding the
PEFT tensors under their PEFT keys, and `index.json` with the PEFT adapter config, which shard
holds each tensor, each shard's sha256 and size, and the revision's content digest (sha256 over
the canonical config and the shard digests). Loading verifies every shard before using it.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mint_core.digests import sha256_file, sha256_json
from mint_core.errors import ConfigurationError, IntegrityError
from mint_core.freezing import PEFT_WEIGHTS, FrozenAdapter

FORMAT = "mint-packed"
FORMAT_VERSION = 1
INDEX = "index.json"
DEFAULT_SHARD_BYTES = 64 << 20


@dataclass(frozen=True)
class PackedIndex:
    """The parsed `index.json` of a packed adapter."""

    adapter_config: dict[str, object]
    tensors: dict[str, str]
    """PEFT key -> shard file name."""
    shards: dict[str, str]
    """Shard file name -> sha256 digest."""
    content_digest: str

    @classmethod
    def read(cls, folder: Path) -> "PackedIndex":
        path = folder / INDEX
        if not path.is_file():
            raise IntegrityError(f"packed adapter {folder} has no {INDEX}; export it again")
        raw = json.loads(path.read_text())
        if raw.get("format") != FORMAT or raw.get("format_version") != FORMAT_VERSION:
            raise ConfigurationError(
                f"{path} is format {raw.get('format')!r} v{raw.get('format_version')!r}; this "
                f"MinT reads {FORMAT!r} v{FORMAT_VERSION}"
            )
        return cls(raw["adapter_config"], raw["tensors"], raw["shards"], raw["content_digest"])


def content_digest(adapter_config: dict[str, object], shard_digests: dict[str, str]) -> str:
    return sha256_json({"config": adapter_config, "shards": shard_digests})


def pack(
    frozen: FrozenAdapter, out_dir: Path, shard_bytes: int = DEFAULT_SHARD_BYTES
) -> PackedIndex:
    """Write `frozen`'s tensors as shards of at most `shard_bytes` (one tensor may exceed it)."""
    if shard_bytes <= 0:
        raise ConfigurationError(f"shard_bytes={shard_bytes} must be > 0")
    tensors = load_file(frozen.path / PEFT_WEIGHTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(tensors):
        nbytes = tensors[key].numel() * tensors[key].element_size()
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append({})
            size = 0
        groups[-1][key] = tensors[key]
        size += nbytes
    placement: dict[str, str] = {}
    shard_digests: dict[str, str] = {}
    for number, group in enumerate(groups):
        name = f"shard-{number:05d}.safetensors"
        save_file(group, out_dir / name)
        shard_digests[name] = sha256_file(out_dir / name)
        placement.update(dict.fromkeys(group, name))
    config = frozen.adapter_config
    index = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "adapter_config": config,
        "tensors": placement,
        "shards": shard_digests,
        "content_digest": content_digest(config, shard_digests),
    }
    (out_dir / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
    return PackedIndex.read(out_dir)


def verify(folder: Path) -> PackedIndex:
    """The index, once every shard exists and matches its digest; IntegrityError otherwise."""
    index = PackedIndex.read(folder)
    for name, expected in index.shards.items():
        path = folder / name
        if not path.is_file():
            raise IntegrityError(f"shard {name} of {folder} is missing (expected {expected})")
        actual = sha256_file(path)
        if actual != expected:
            raise IntegrityError(
                f"shard {name} of {folder} has digest {actual}, index says {expected}; the "
                "artifact is corrupt: re-export the revision"
            )
    if content_digest(index.adapter_config, index.shards) != index.content_digest:
        raise IntegrityError(f"index of {folder} does not match its content digest")
    return index


def load(folder: Path) -> tuple[PackedIndex, dict[str, torch.Tensor]]:
    """Verified index and every tensor under its PEFT key."""
    index = verify(folder)
    tensors: dict[str, torch.Tensor] = {}
    for name in index.shards:
        tensors.update(load_file(folder / name))
    return index, tensors
