"""The resident base model: a Hugging Face causal LM folder, loaded with `AutoModelForCausalLM`
and `AutoTokenizer`, and its identity.

`MINT_BASE_MODEL` names a local folder (config.json, safetensors weights, tokenizer files) or a
hub id already in the local Hugging Face cache; nothing is downloaded. Unset, it is the
embedded default (`mint_core.model.tiny`), built once under `MINT_HOME/base/`.

Identity: `model_id` (the hub id, or the folder's name) and `digest`, a sha256 over the weight
files' sha256 in name order. Each file's digest is cached by (path, size, mtime), so a 16 GB
base is hashed once, not at every registration.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mint_core.artifacts.digests import sha256_file, sha256_json
from mint_core.errors import ConfigurationError
from mint_core.model.text import TextCodec
from mint_core.model.tiny import TinySpec, ensure_tiny

# torch and transformers (seconds to import) are imported where a model is loaded.
if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

DTYPES = ("float32", "bfloat16", "float16")
WEIGHT_SUFFIXES = (".safetensors", ".bin")
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The attention and MLP projections of a decoder layer in the Llama, Qwen2, Qwen3 and Mistral
families: what a LoRA adapts unless told otherwise."""
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MOE_FAMILIES = ("qwen3_moe", "mixtral")
FAMILY_TARGETS: dict[str, tuple[str, ...]] = {
    family: DEFAULT_TARGETS for family in ("llama", "qwen2", "qwen3", "mistral")
} | {family: ATTENTION_TARGETS for family in MOE_FAMILIES}
"""Default LoRA target modules per `config.model_type`; other families get every linear layer
of their decoder (`servable_modules`). An MoE family's MLPs are fused experts, not linear
layers: `FAMILY_EXPERT_TARGETS` adapts them."""
FAMILY_EXPERT_TARGETS: dict[str, tuple[str, ...]] = {
    family: ("mlp.experts.gate_up_proj", "mlp.experts.down_proj") for family in MOE_FAMILIES
}
"""Default fused expert parameters (PEFT's `target_parameters`) per `config.model_type`;
other families get none."""


@dataclass(frozen=True)
class BaseSource:
    """Which base to serve and train on, and how to place it (`MINT_BASE_MODEL`, `MINT_DTYPE`,
    `MINT_DEVICE`)."""

    name: str = ""
    """A model folder or a hub id in the local Hugging Face cache; "" is the embedded default."""
    dtype: str = ""
    """`float32`, `bfloat16` or `float16`; "" is float32 on CPU, the config's dtype on CUDA."""
    device: str = ""
    """`cpu`, `cuda` or `cuda:N`; "" is cuda when there is one."""

    def __post_init__(self) -> None:
        if self.dtype and self.dtype not in DTYPES:
            raise ConfigurationError(f"MINT_DTYPE={self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.device and not (
            self.device in ("cpu", "cuda")
            or (self.device.startswith("cuda:") and self.device[5:].isdigit())
        ):
            raise ConfigurationError(
                f"MINT_DEVICE={self.device!r} is not cpu, cuda or cuda:N (e.g. cuda:0)"
            )


@dataclass(frozen=True)
class BaseIdentity:
    """What an adapter's policy record says its base is."""

    model_id: str
    digest: str
    """sha256 over the weight files' digests, `sha256:<hex>`."""


@dataclass(frozen=True)
class BaseText:
    """A base as a server sees it before (or without) loading its weights: identity, text side
    and the config facts serving needs. Engines that load the weights themselves (vLLM) need
    only this."""

    identity: BaseIdentity
    codec: TextCodec
    path: Path
    family: str
    """`config.model_type`: llama, qwen2, qwen3, mistral..."""
    context_length: int
    """Longest sequence (prompt + answer) the model takes."""

    @property
    def model_id(self) -> str:
        return self.identity.model_id

    @property
    def digest(self) -> str:
        return self.identity.digest

    @property
    def name_or_path(self) -> str:
        """What `from_pretrained` loads this base from, as adapter configs record it
        (`base_model_name_or_path`): the hub id, else the folder's full path. A folder's model
        id is only its name, which no loader finds."""
        return self.model_id if "/" in self.model_id else str(self.path)


@dataclass(frozen=True)
class BaseModel:
    """A loaded base model: its weights and its `BaseText`."""

    model: PreTrainedModel
    text: BaseText

    @property
    def codec(self) -> TextCodec:
        return self.text.codec

    @property
    def identity(self) -> BaseIdentity:
        return self.text.identity

    @property
    def path(self) -> Path:
        return self.text.path

    @property
    def model_id(self) -> str:
        return self.text.model_id

    @property
    def digest(self) -> str:
        return self.text.digest

    @property
    def name_or_path(self) -> str:
        return self.text.name_or_path

    @property
    def family(self) -> str:
        return self.text.family

    @property
    def context_length(self) -> int:
        return self.text.context_length

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def resolve(
    source: BaseSource, home: Path, progress: Callable[[int, int], None] | None = None
) -> tuple[Path, str]:
    """(model folder, model id) of `source`; the embedded default is built if missing, with
    `progress(step, total)` after each of its pretraining steps."""
    if not source.name:
        folder = ensure_tiny(TinySpec(), home / "base", progress)
        return folder, folder.name
    path = Path(source.name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigurationError(
                f"MINT_BASE_MODEL={source.name} has no config.json: point it at a Hugging Face "
                "model folder (config.json, weights, tokenizer files)"
            )
        return path.absolute(), path.absolute().name
    if path.is_absolute() or source.name.startswith(".") or source.name.count("/") != 1:
        raise ConfigurationError(
            f"MINT_BASE_MODEL={source.name} is neither a model folder nor a hub id (org/name)"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = snapshot_download(source.name, local_files_only=True)
    except LocalEntryNotFoundError as e:
        raise ConfigurationError(
            f"MINT_BASE_MODEL={source.name} is not in the local Hugging Face cache and MinT "
            f"never downloads at run time: run `hf download {source.name}` first (or set "
            "MINT_BASE_MODEL to a model folder)"
        ) from e
    return Path(folder), source.name


def identity(source: BaseSource, home: Path) -> BaseIdentity:
    """The identity adapters trained on `source` carry, without loading the model."""
    return _identity(*resolve(source, home), home)


def _identity(folder: Path, model_id: str, home: Path) -> BaseIdentity:
    return BaseIdentity(model_id, weights_digest(folder, home / "cache" / "base-digests.json"))


def weights_digest(folder: Path, cache_file: Path) -> str:
    """sha256 over (name, sha256) of the folder's weight files in name order; each file's
    digest is reused while its path, size and mtime stay the same."""
    files = sorted(p for p in folder.iterdir() if p.name.endswith(WEIGHT_SUFFIXES))
    if not files:
        raise ConfigurationError(
            f"{folder} holds no weight files (*.safetensors or *.bin); save the model with "
            "save_pretrained"
        )
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    digests, hashed = {}, False
    for path in files:
        stat = path.stat()  # follows the links of the Hugging Face cache to the blobs
        key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
        if key not in cache:
            cache[key], hashed = sha256_file(path), True
        digests[path.name] = cache[key]
    if hashed:  # every registration asks; only a newly hashed file changes the cache
        _write_atomically(cache_file, json.dumps(cache, indent=1, sort_keys=True))
    return sha256_json(digests)


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f".{path.name}.{os.getpid()}")
    scratch.write_text(text)
    scratch.replace(path)


def load_text(source: BaseSource, home: Path) -> BaseText:
    """`source`'s identity, tokenizer, chat template and config, without its weights."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    folder, model_id = resolve(source, home)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigurationError(
            f"the base model {model_id} ({folder}) has no usable tokenizer: save the model's "
            "tokenizer beside its weights (tokenizer.save_pretrained; MinT needs its "
            f"tokenizer.json) so MinT can turn text into tokens (transformers said: {e})"
        ) from e
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigurationError(
            f"the base model {model_id} ({folder}) has a slow tokenizer only; MinT needs a "
            "tokenizer.json (a fast tokenizer) for offsets and streaming"
        )
    try:
        generation = GenerationConfig.from_pretrained(folder, local_files_only=True)
    except OSError:
        generation = None
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    return BaseText(
        _identity(folder, model_id, home),
        TextCodec(tokenizer, generation, model_id),
        folder,
        str(config.model_type),
        int(config.max_position_embeddings),
    )


def load_base(source: BaseSource, home: Path, *, training: bool = False) -> BaseModel:
    """The base model of `source` on its device, frozen, in eval mode unless `training`."""
    import torch
    from transformers import AutoModelForCausalLM

    text = load_text(source, home)
    device = torch.device(source.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, source.dtype) if source.dtype else None
    if dtype is None and device.type == "cpu":
        dtype = torch.float32  # CPU kernels for half precision are slow or missing
    # Fused MoE experts run transformers' eager per-expert loop: the trainer, the engine's
    # expert slots (which reproduce that loop) and PEFT then compute alike, and a base row on
    # the engine equals the base bit for bit. (The default, grouped_mm, is for GPUs.)
    model = AutoModelForCausalLM.from_pretrained(
        text.path, dtype=dtype or "auto", local_files_only=True, experts_implementation="eager"
    ).to(device)
    model.train(training)
    model.requires_grad_(False)
    return BaseModel(model, text)


def servable_modules(model: torch.nn.Module, output: bool = False) -> dict[str, torch.nn.Linear]:
    """Every linear layer a LoRA may adapt, by module name: all but the output embedding, and
    that too with `output` (the serving engine serves a LoRA on it; the release pipeline's
    training does not make one)."""
    from torch import nn

    embedding = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and (output or module is not embedding)
    }


def output_embedding_name(model: torch.nn.Module) -> str | None:
    """The module name of `model`'s output embedding (`lm_head`), if it has one."""
    embedding = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return next((name for name, module in model.named_modules() if module is embedding), None)


def default_targets(model: torch.nn.Module) -> tuple[str, ...]:
    """The module names a LoRA adapts by default on this model's family."""
    family = str(getattr(model.config, "model_type", ""))
    if family in FAMILY_TARGETS:
        return FAMILY_TARGETS[family]
    return tuple(sorted({name.rsplit(".", 1)[-1] for name in servable_modules(model)}))


def default_expert_targets(model: torch.nn.Module) -> tuple[str, ...]:
    """The fused expert parameters a LoRA adapts by default on this model's family."""
    return FAMILY_EXPERT_TARGETS.get(str(getattr(model.config, "model_type", "")), ())
