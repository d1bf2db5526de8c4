"""The resident base model: a tiny Llama-style causal LM built from config, never downloaded.

MinT keeps one base model loaded and moves only adapters. Here the base is small enough to
pretrain on a CPU in well under a minute; it is pretrained once on `echo` (so it can emit every
character the adapters' tasks need) and cached under `MINT_HOME/base/<spec key>/`. The base
digest, the sha256 of its weights file, is what every adapter's policy record is checked against.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mint_core.datasets import Task, training_stream
from mint_core.digests import sha256_file
from mint_core.errors import ConfigurationError
from mint_core.folders import publish_folder
from mint_core.tokenizer import CharTokenizer

# torch and transformers (seconds to import) are imported where a model is built or loaded:
# every command reads the spec through MintConfig, and `mint status` needs no model.
if TYPE_CHECKING:
    from transformers import LlamaConfig, LlamaForCausalLM

_WEIGHTS_FILE = "model.safetensors"
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The attention and MLP projections of a decoder layer that a LoRA may adapt."""


@dataclass(frozen=True)
class BaseModelSpec:
    """Everything that determines the base model's weights: same spec, same bytes."""

    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 4
    """Decoder layers."""
    num_heads: int = 4
    """Attention heads (also key/value heads: no grouped-query attention at this size)."""
    intermediate_size: int = 256
    """Width of each MLP's hidden layer."""
    max_positions: int = 64
    """Longest sequence (prompt + answer) the model is built for."""
    seed: int = 0
    """Seeds initialisation and the pretraining data stream."""
    pretrain_steps: int = 250
    """Steps of `echo` pretraining; 0 leaves the random initialisation."""
    pretrain_batch_size: int = 64
    """Examples per pretraining step."""
    pretrain_learning_rate: float = 3e-3
    """Peak AdamW learning rate of pretraining."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise ConfigurationError(f"base model {name}={getattr(self, name)} must be > 0")
        if self.hidden_size % self.num_heads:
            raise ConfigurationError(
                f"base model hidden_size={self.hidden_size} is not divisible by "
                f"num_heads={self.num_heads}; pick sizes that divide"
            )

    @property
    def key(self) -> str:
        """Short content key of the spec: names the cache folder and the model id."""
        canonical = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    @property
    def model_id(self) -> str:
        return f"mint-tiny-llama-{self.key}"

    def llama_config(self) -> LlamaConfig:
        from transformers import LlamaConfig

        tokenizer = CharTokenizer()
        return LlamaConfig(
            vocab_size=tokenizer.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_heads,
            max_position_embeddings=self.max_positions,
            tie_word_embeddings=True,
            pad_token_id=tokenizer.pad_id,
            bos_token_id=tokenizer.bos_id,
            eos_token_id=tokenizer.eos_id,
        )


@dataclass(frozen=True)
class BaseModel:
    """A loaded base model with the identity adapters are checked against."""

    spec: BaseModelSpec
    model: LlamaForCausalLM
    digest: str
    """sha256 of the weights file, `sha256:<hex>`."""
    path: Path

    @property
    def model_id(self) -> str:
        return self.spec.model_id


def _cached(spec: BaseModelSpec, home: Path) -> Path:
    """The cache folder of `spec` under `home`, built and pretrained first if missing."""
    folder = home / "base" / spec.key
    if not (folder / _WEIGHTS_FILE).exists():
        _build_into(spec, folder)
    return folder


def base_digest(spec: BaseModelSpec, home: Path) -> str:
    """The digest adapters trained on `spec` must carry, without loading the model."""
    return sha256_file(_cached(spec, home) / _WEIGHTS_FILE)


def load_base(spec: BaseModelSpec, home: Path) -> BaseModel:
    """The base model for `spec`, from the cache under `home`, built and pretrained if missing."""
    import torch
    from transformers import LlamaForCausalLM

    folder = _cached(spec, home)
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    model.requires_grad_(False)
    return BaseModel(spec=spec, model=model, digest=base_digest(spec, home), path=folder)


def _build_into(spec: BaseModelSpec, folder: Path) -> None:
    """Pretrain and save atomically, so a crash or a concurrent builder never leaves half a base."""
    model = _pretrain(spec)
    with publish_folder(folder, prefix=f".{spec.key}-") as staging:
        model.save_pretrained(staging)
        (staging / "mint-spec.json").write_text(json.dumps(asdict(spec), indent=2, sort_keys=True))


def _pretrain(spec: BaseModelSpec) -> LlamaForCausalLM:
    import torch
    from transformers import LlamaForCausalLM

    from mint_core.textgen import batch_examples, seeded

    with seeded(spec.seed):
        model = LlamaForCausalLM(spec.llama_config())
    if spec.pretrain_steps == 0:
        return model
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.pretrain_learning_rate)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=spec.pretrain_learning_rate, total_steps=spec.pretrain_steps
    )
    stream = training_stream(Task.ECHO, spec.seed, mixed_case=True)
    tokenizer = CharTokenizer()
    for _ in range(spec.pretrain_steps):
        batch = batch_examples([next(stream) for _ in range(spec.pretrain_batch_size)], tokenizer)
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    return model
