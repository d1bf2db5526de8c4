"""Helpers several test modules of every lane share (fixtures stay in the conftest.py files; a
test module imports nothing from another test module): synthetic adapters, tiny bases and
tiny members of each model family built in-process, tiny engines' adapters, a policy
record, and a registry held in memory. Nothing here starts a process or imports the process
machinery (services, workers, Prefect, S3, PostgreSQL): tests/unit imports it; what
integration tests share besides is tests/integration/helpers.py."""

import copy
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PreTrainedConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from mint_core.artifacts.folders import publish_folder
from mint_core.errors import NotFoundError
from mint_core.model.base import BaseModel, BaseSource, load_base
from mint_core.model.generate import seeded
from mint_core.model.tiny import SPECIAL_TOKENS, TinySpec, ensure_tiny, save_base_folder
from mint_core.model.toy import held_out_words, prompt_for
from mint_core.registry import AdapterAliases, RegisteredRevision
from mint_core.revisions import PolicyRecord, RevisionId, RevisionRef
from mint_core.states import Stage

# --- Adapters made for tests ---------------------------------------------------------------


def random_lora(model: torch.nn.Module, lora: LoraConfig, seed: int, std: float) -> PeftModel:
    """A PEFT LoRA over a copy of `model` with random non-zero weights: a stand-in for one that
    learned something (PEFT initialises B to zero, which would change nothing)."""
    with seeded(seed):
        peft = get_peft_model(copy.deepcopy(model), lora)
        with torch.no_grad():
            for name, parameter in peft.named_parameters():
                if "lora_" in name:
                    parameter.normal_(0.0, std)
    return peft.eval()


def tiny_base(spec: TinySpec, home: Path) -> BaseModel:
    """A tiny base built from `spec` under `home`, loaded as any model folder is."""
    return load_base(BaseSource(str(ensure_tiny(spec, home / "base"))), home)


def make_policy(**changes: object) -> PolicyRecord:
    """A complete policy record for support-bot; `changes` replace its fields."""
    values: dict[str, object] = {
        "adapter": "support-bot",
        "content_digest": "sha256:" + "a" * 64,
        "base_model_id": "mint-tiny-llama-x",
        "base_digest": "sha256:" + "b" * 64,
        "dataset": "/data/upper.jsonl",
        "training_steps": 200,
        "dataset_digest": "sha256:" + "c" * 64,
        "lora_rank": 8,
        "lora_alpha": 16,
        "target_modules": ("q_proj", "v_proj"),
        "created_by": "alice",
        "created_at": "2026-11-29T00:00:00+00:00",
        "parent_revision": 2,
        "frozen_digest": "sha256:" + "d" * 64,
        "principals": ("team-a", "team-b"),
        "eval_metrics": {"eval_exact_match": 0.97},
    }
    values.update(changes)
    return PolicyRecord(**values)  # type: ignore[arg-type]


# --- Tiny members of each model family ---------------------------------------------------------

_SHAPE = {"vocab_size": len(SPECIAL_TOKENS) + 256, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 128,
          "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
_FAMILIES: dict[str, tuple[type[PreTrainedConfig], dict[str, object]]] = {
    # Grouped-query attention, untied embeddings.
    "llama": (LlamaConfig, {"num_key_value_heads": 2, "tie_word_embeddings": False}),
    # Biases on q/k/v, tied embeddings.
    "qwen2": (Qwen2Config, {"num_key_value_heads": 2, "tie_word_embeddings": True}),
    # q/k norms, heads of 32 over a 64-wide stream (head size is not hidden / heads).
    "qwen3": (Qwen3Config, {"num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": True}),
    # One key/value head for four query heads, untied, no sliding window.
    "mistral": (MistralConfig, {"num_key_value_heads": 1, "sliding_window": None,
                                "tie_word_embeddings": False}),
    # Fused experts (4, top-2, top-k weights renormalised as Qwen3-30B-A3B does), q/k norms.
    "qwen3_moe": (Qwen3MoeConfig, {"num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
                                   "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                   "norm_topk_prob": True, "tie_word_embeddings": True}),
    # Fused experts of intermediate_size, a router that always renormalises, untied.
    "mixtral": (MixtralConfig, {"num_key_value_heads": 2, "num_local_experts": 4,
                                "num_experts_per_tok": 2, "sliding_window": None,
                                "tie_word_embeddings": False}),
}  # fmt: skip
FAMILIES = tuple(sorted(_FAMILIES))
"""The model families MinT serves and trains, each with a tiny member built from config."""
MOE_FAMILIES = ("mixtral", "qwen3_moe")
"""Those whose MLPs are fused experts (adapted through PEFT's `target_parameters`)."""
DENSE_FAMILIES = tuple(f for f in FAMILIES if f not in MOE_FAMILIES)


def family_folder(family: str, root: Path, **changes: object) -> Path:
    """A model folder of a tiny random `family` member under `root` (built once, atomically):
    the byte tokenizer with its chat template, saved with `save_pretrained`. `changes` go to the
    config (e.g. `initializer_range`)."""
    config_class, extra = _FAMILIES[family]
    name = f"tiny-{family}" + "".join(f"-{k}-{v}" for k, v in sorted(changes.items()))
    folder = root / name
    if not folder.exists():
        with seeded(0):
            model = AutoModelForCausalLM.from_config(config_class(**_SHAPE, **extra, **changes))
        with publish_folder(folder, prefix=f".{name}-") as staging:
            save_base_folder(model, staging)
    return folder


# --- Tiny engines (engine and scheduler tests) ----------------------------------------------

ENGINE_SPEC = TinySpec(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                       pretrain_steps=0)  # fmt: skip
"""An untrained base small enough to build in a moment, for engine-level tests."""
ENGINE_PROMPTS = [prompt_for(word) for word in held_out_words(8)]
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def random_adapter(
    base: BaseModel, rank: int, seed: int, targets: list[str] | None = None
) -> tuple[LoraConfig, PeftModel]:
    """A LoRA with random (non-zero) weights; odd seeds use rsLoRA scaling."""
    lora = LoraConfig(r=rank, lora_alpha=2 * rank + seed, use_rslora=seed % 2 == 1,
                      target_modules=targets or PROJECTIONS)  # fmt: skip
    return lora, random_lora(base.model, lora, seed, std=0.2)


def config_of(lora: LoraConfig) -> dict[str, object]:
    """The adapter config an engine is given, as a packed index holds it."""
    return lora.to_dict() | {"peft_type": "LORA", "target_modules": sorted(lora.target_modules)}


def weights_of(model: PeftModel) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}


BASE_DIGEST = "sha256:" + "e" * 64
"""The base every revision of a `MemoryRegistry` is for."""


class MemoryRegistry:
    """What a catalog reads of MLflow, held in memory: each change moves the adapter's
    last-updated time, as MLflow's does."""

    def __init__(self) -> None:
        self.revisions: dict[RevisionId, RegisteredRevision] = {}
        self.adapters: dict[str, AdapterAliases] = {}
        self.clock_ms = 1000

    def add(self, adapter: str, number: int) -> None:
        policy = make_policy(adapter=adapter, content_digest=f"sha256:{number:064d}")
        uri = f"mint-local://sha256/{number:064d}"
        self.revisions[RevisionId(adapter, number)] = RegisteredRevision(
            RevisionId(adapter, number), policy, uri, Stage.REGISTERED, (), {}
        )
        self.set(adapter)

    def set(self, adapter: str, share: float | None = None, **aliases: int) -> None:
        old = self.adapters.get(adapter)
        aliases_now = dict(old.aliases) if old else {}
        aliases_now.update(aliases)
        self.clock_ms += 10
        self.adapters[adapter] = AdapterAliases(
            adapter, aliases_now, self.clock_ms, BASE_DIGEST, share
        )

    def adapters_changed_since(self, since_ms: int) -> list[AdapterAliases]:
        return [a for a in self.adapters.values() if a.updated_ms >= since_ms]

    def all_revisions(self) -> Iterator[list[RegisteredRevision]]:
        yield list(self.revisions.values())

    def has_adapter(self, adapter: str) -> bool:
        return adapter in self.adapters

    def get(self, revision: RevisionId) -> RegisteredRevision:
        if revision not in self.revisions:
            raise NotFoundError(f"{revision} is not registered")
        named = self.adapters[revision.adapter].aliases.items()
        aliases = tuple(sorted(alias for alias, n in named if n == revision.number))
        return dataclasses.replace(self.revisions[revision], aliases=aliases)

    def resolve(self, ref: RevisionRef) -> RegisteredRevision:
        raise NotFoundError(f"{ref} names nothing")
