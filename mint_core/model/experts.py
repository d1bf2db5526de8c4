"""Fused MoE experts and the LoRA adapters PEFT puts on them: one definition of the key rule.

transformers 5 stores an MoE layer's experts fused, as 3-D parameters of one module
(`mlp.experts.gate_up_proj [experts, 2*intermediate, hidden]` and
`mlp.experts.down_proj [experts, hidden, intermediate]` in Qwen3-MoE and Mixtral, each expert's
matrix `out x in`). PEFT adapts such parameters with `LoraConfig.target_parameters`: one
`ParamWrapper` per parameter whose `lora_A` is `[rank*experts, in]` (expert-major: row
`e*rank + j`) and `lora_B` `[out, rank*experts]` (expert-minor: column `j*experts + e`); the
delta of expert `e` is `scaling * B_e @ A_e`.

Two adapted parameters of one module are *nested* wrappers, and the saved keys tell them apart
only by depth: with the module's adapted parameters `p_0 .. p_{n-1}` in declaration order
(`named_parameters`, which is the order PEFT wraps them in, innermost first), `p_k`'s tensors
are saved under the module's name followed by `.base_layer` repeated `n-1-k` times. So
Qwen3-MoE's `gate_up_proj` is `mlp.experts.base_layer.lora_A.weight` and its `down_proj`
`mlp.experts.lora_A.weight` when both are adapted. Everything in MinT that reads such keys
(import, packing, the engine) goes through `expert_lora_targets`.
"""

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from mint_core.errors import ConfigurationError

EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
"""The fused expert parameters of Qwen3-MoE and Mixtral, in declaration order."""
BASE_LAYER = ".base_layer"


@dataclass(frozen=True)
class ExpertTarget:
    """One fused expert parameter an adapter adapts, and where its LoRA pair is saved."""

    module: str
    """The experts module's name in the bare model, e.g. `model.layers.0.mlp.experts`."""
    parameter: str
    """`gate_up_proj` or `down_proj`."""
    key: str
    """The PEFT module key its `lora_A` / `lora_B` hang under (module name plus `.base_layer`s)."""
    experts: int
    out_features: int
    in_features: int


def experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every fused experts module of `model` by name: one holding the 3-D `gate_up_proj` and
    `down_proj` parameters, stored `out x in` per expert (transformers' default layout)."""
    found = {}
    for name, module in model.named_modules():
        params = dict(module.named_parameters(recurse=False))
        if all(p in params and params[p].dim() == 3 for p in EXPERT_PARAMETERS):
            if getattr(module, "is_transposed", False):
                raise ConfigurationError(
                    f"{name} stores its experts transposed (in x out); MinT adapts only "
                    "transformers' default out x in layout"
                )
            found[name] = module
    return found


def expert_lora_targets(
    model: nn.Module, target_parameters: list[str] | tuple[str, ...] | None
) -> dict[str, ExpertTarget]:
    """The fused expert parameters `target_parameters` (PEFT's patterns: a full
    `module.parameter` name or a `.`-separated suffix of one) select in `model`, by the PEFT
    module key their LoRA pair is saved under (without `base_model.model.`)."""
    if not target_parameters:
        return {}
    targets: dict[str, ExpertTarget] = {}
    for name, module in experts_modules(model).items():
        chosen = [
            (param_name, param)
            for param_name, param in module.named_parameters(recurse=False)
            if _selects(target_parameters, f"{name}.{param_name}")
        ]
        for depth, (param_name, param) in enumerate(reversed(chosen)):
            key = name + BASE_LAYER * depth
            experts, out_features, in_features = param.shape
            targets[key] = ExpertTarget(name, param_name, key, experts, out_features, in_features)
    return targets


def expert_stacks(
    a: torch.Tensor, b: torch.Tensor, experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's flat pair (A `[rank*experts, in]`, B `[out, rank*experts]`) as per-expert stacks
    (A `[experts, rank, in]`, B `[experts, out, rank]`), views of the same storage."""
    rank = a.shape[0] // experts
    if a.shape[0] != rank * experts or b.shape[1] != rank * experts:
        raise ConfigurationError(
            f"an expert LoRA pair A {list(a.shape)}, B {list(b.shape)} is not rank x "
            f"{experts} experts"
        )
    return a.reshape(experts, rank, a.shape[1]), b.reshape(b.shape[0], rank, experts).permute(
        2, 0, 1
    )


def _selects(patterns: list[str] | tuple[str, ...], name: str) -> bool:
    """Whether one of PEFT's `target_parameters` patterns (a full name or a `.`-separated
    suffix of one) selects the parameter `name`."""
    return any(name == pattern or name.endswith(f".{pattern}") for pattern in patterns)


def fused_expert_parameter(
    module_key: str, target_parameters: list[str] | tuple[str, ...] | None
) -> tuple[str, str] | None:
    """(experts module, parameter) that the PEFT module key `module_key` (with or without
    `base_model.model.`) adapts, read without the model: for packing, which sees only an
    adapter's config and tensors. It assumes the Qwen3-MoE / Mixtral layout (a module named
    `experts` declaring `EXPERT_PARAMETERS` in that order), which `expert_lora_targets` checks
    against a real model at training and import. None for a key of no fused expert."""
    if not target_parameters:
        return None
    depth = 0
    while module_key.endswith(BASE_LAYER):
        module_key, depth = module_key.removesuffix(BASE_LAYER), depth + 1
    if module_key.rpartition(".")[2] != "experts":
        return None
    chosen = [p for p in EXPERT_PARAMETERS if _selects(target_parameters, f"{module_key}.{p}")]
    if depth >= len(chosen):
        return None
    return module_key, chosen[len(chosen) - 1 - depth]


def expert_rank(adapter_config: Mapping[str, object], module: str, parameter: str) -> int:
    """The LoRA rank PEFT gives `module.parameter`: the first `rank_pattern` entry matching
    its name (PEFT's `get_pattern_key` rule: the pattern is a regex for a `.`-separated suffix),
    else `r`. PEFT itself writes a pattern when it turns `gate_proj`/`up_proj` targets into
    `gate_up_proj` at twice the rank."""
    from peft.utils.other import get_pattern_key  # PEFT is heavy; packing imports this module

    patterns = adapter_config.get("rank_pattern") or {}
    if not isinstance(patterns, dict):
        raise ConfigurationError(f"rank_pattern={patterns!r} is not a mapping of pattern to rank")
    pattern = get_pattern_key(list(patterns), f"{module}.{parameter}")
    return int(patterns.get(pattern, adapter_config["r"]))  # type: ignore[call-overload]
