"""Synthetic LoRA adapters in the shape of a mixture-of-experts model, for the packing and
RL sync benchmarks and the packing tests (not domain code: nothing in MinT makes them). The
reference shape is a Qwen3-30B-A3B-like model: a rank-1 bf16 LoRA on q/k/v/o and on every
expert's gate/up/down projection is 37,248 tensors, about 110 MB."""

import dataclasses
from dataclasses import dataclass

import torch

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class MoeLoraShape:
    """The dimensions that determine a MoE LoRA's tensors."""

    layers: int = 48
    """Decoder layers, each with its own attention and experts."""
    experts: int = 128
    """Experts per layer; each has gate, up and down projections."""
    hidden: int = 2048
    """Width of the residual stream."""
    expert_intermediate: int = 768
    """Width of each expert's hidden layer."""
    query_heads: int = 32
    kv_heads: int = 4
    """Key/value heads (grouped-query attention)."""
    head_dim: int = 128
    rank: int = 1
    """LoRA rank r of every pair."""
    dtype: torch.dtype = torch.bfloat16

    @property
    def tensor_count(self) -> int:
        per_layer = self.experts * len(EXPERT_PROJECTIONS) * 2 + len(ATTENTION_PROJECTIONS) * 2
        return self.layers * per_layer

    def projection_dims(self, projection: str) -> tuple[int, int]:
        """(in_features, out_features) of a projection."""
        q, kv = self.query_heads * self.head_dim, self.kv_heads * self.head_dim
        return {
            "q_proj": (self.hidden, q),
            "k_proj": (self.hidden, kv),
            "v_proj": (self.hidden, kv),
            "o_proj": (q, self.hidden),
            "gate_proj": (self.hidden, self.expert_intermediate),
            "up_proj": (self.hidden, self.expert_intermediate),
            "down_proj": (self.expert_intermediate, self.hidden),
        }[projection]

    def scaled(self, factor: float) -> "MoeLoraShape":
        """A smaller case with the same structure (layers and experts scaled by `factor`)."""
        return dataclasses.replace(
            self,
            layers=max(1, round(self.layers * factor)),
            experts=max(2, round(self.experts * factor)),
        )


QWEN3_30B_A3B = MoeLoraShape()


def moe_lora_tensors(shape: MoeLoraShape, seed: int = 0) -> dict[str, torch.Tensor]:
    """PEFT's per-expert keys with seeded random values."""
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}

    def pair(module: str, projection: str) -> None:
        fan_in, fan_out = shape.projection_dims(projection)
        for ab, dims in (("A", (shape.rank, fan_in)), ("B", (fan_out, shape.rank))):
            values = torch.randn(dims, generator=generator).to(shape.dtype)
            tensors[f"base_model.model.model.layers.{module}.lora_{ab}.weight"] = values

    for layer in range(shape.layers):
        for projection in ATTENTION_PROJECTIONS:
            pair(f"{layer}.self_attn.{projection}", projection)
        for expert in range(shape.experts):
            for projection in EXPERT_PROJECTIONS:
                pair(f"{layer}.mlp.experts.{expert}.{projection}", projection)
    return tensors


def moe_adapter_config(shape: MoeLoraShape) -> dict[str, object]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "qwen3-30b-a3b-shaped",
        "r": shape.rank,
        "lora_alpha": 2 * shape.rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(ATTENTION_PROJECTIONS + EXPERT_PROJECTIONS),
    }
