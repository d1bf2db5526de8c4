"""Freeze: snapshot a trained PEFT adapter into immutable, digested files.

After this step a revision's bytes never change. The frozen folder is named by its digest (over
the manifest of file digests), made read-only, and written atomically, so freezing the same
bytes twice yields the same folder and a crash never leaves half of one. Weights that are not
finite (NaN or infinity) are refused: one such value makes every answer of the adapter garbage.
"""

import json
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

from mint_core.artifacts.digests import sha256_file, sha256_json
from mint_core.artifacts.folders import publish_folder
from mint_core.errors import ConfigurationError, IntegrityError

if TYPE_CHECKING:
    import torch

PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class FrozenAdapter:
    path: Path
    digest: str
    """sha256 over the manifest: names these exact bytes."""
    files: dict[str, str]
    """File name -> sha256 digest."""

    @property
    def adapter_config(self) -> dict[str, object]:
        return json.loads((self.path / PEFT_CONFIG).read_text())


def freeze(adapter_dir: Path, frozen_root: Path) -> FrozenAdapter:
    """Copy a PEFT adapter directory into `frozen_root/<digest>/`, read-only."""
    sources = [adapter_dir / PEFT_WEIGHTS, adapter_dir / PEFT_CONFIG]
    missing = [str(p) for p in sources if not p.is_file()]
    if missing:
        raise ConfigurationError(
            f"{adapter_dir} is not a PEFT adapter directory: missing {missing}; pass the folder "
            "that PeftModel.save_pretrained wrote"
        )
    check_finite_file(adapter_dir / PEFT_WEIGHTS)
    files = {p.name: sha256_file(p) for p in sources}
    digest = sha256_json(files)
    target = frozen_root / digest.removeprefix("sha256:")
    if not target.exists():
        with publish_folder(target, prefix=".freeze-") as staging:
            for source in sources:
                shutil.copyfile(source, staging / source.name)
            (staging / MANIFEST).write_text(json.dumps(files, indent=2, sort_keys=True))
            for item in staging.iterdir():
                item.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    return open_frozen(target)


def open_frozen(path: Path) -> FrozenAdapter:
    """A frozen adapter, after checking every file against its manifest."""
    files: dict[str, str] = json.loads((path / MANIFEST).read_text())
    for name, expected in files.items():
        actual = sha256_file(path / name)
        if actual != expected:
            raise IntegrityError(
                f"frozen file {path / name} has digest {actual}, manifest says {expected}; the "
                "frozen copy is damaged: freeze the adapter again from its training output"
            )
    return FrozenAdapter(path=path, digest=sha256_json(files), files=files)


def check_finite(name: str, tensor: "torch.Tensor", source: object) -> None:
    """ConfigurationError naming tensor `name` of `source` if it holds NaN or infinity."""
    # torch is imported where tensors are read, not with this module: a promotion or rollback
    # opens frozen folders (`open_frozen`) and never reads a tensor.
    import torch

    finite = torch.isfinite(tensor)
    if bool(finite.all()):
        return
    nan = int(torch.isnan(tensor).sum())
    raise ConfigurationError(
        f"{source}: tensor {name!r} holds {nan} NaN and {int((~finite).sum()) - nan} infinite "
        f"values (of {tensor.numel()}); MinT refuses adapters whose weights are not finite: "
        "retrain the adapter (a lower learning rate if its training diverged) or repair its "
        "weights"
    )


def check_finite_file(path: Path) -> None:
    """`check_finite` for every tensor of the safetensors file `path`, one at a time."""
    with safe_open(path, framework="pt") as weights:
        for name in list(weights.keys()):  # safe_open is not iterable
            check_finite(name, weights.get_tensor(name), path)
