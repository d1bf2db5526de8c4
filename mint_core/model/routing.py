"""R3 routing replay: record which experts an MoE model routed each token to, and replay them.

An RL sampler and a trainer that score the same tokens with the same weights can still pick
different experts (near-tied router scores, different kernels, a router that moved by one
step), and a token routed elsewhere sees a different network: its log-probability under the
trainer no longer estimates the sampler's. R3 records the sampler's top-k expert indices and
makes the trainer use exactly those. The gate weights are *not* replayed: they are recomputed
from the trainer's own router logits over the replayed experts, so the router keeps its
gradient.

Both work through a forward hook on each MoE block's router (`mlp.gate`), which returns
`(logits, scores, indices)` in transformers' Qwen3-MoE and Mixtral. The hook only changes what
the router hands to the experts, so it works under every experts implementation (eager,
grouped_mm, ...) and under PEFT, which leaves the router unwrapped.

Routes are `[batch, seq, layers, top_k]` integer tensors aligned with `input_ids`; one row is
`[seq, layers, top_k]`.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from mint_core.errors import ConfigurationError

_NORMALISES_ALWAYS = frozenset({"MixtralTopKRouter"})
"""Routers that renormalise their top-k weights unconditionally (Mixtral's `forward`)."""
_NORMALISES_BY_CONFIG = frozenset({"Qwen3MoeTopKRouter"})
"""Routers that renormalise iff their `norm_topk_prob` says so (Qwen3-MoE defaults to False)."""

Shapes = list[tuple[int, ...]]
"""Per MoE layer, the shape of the block input its router last saw flattened."""


@dataclass(frozen=True)
class MoeGate:
    """One MoE layer's router and how to recompute its gate weights for replayed experts."""

    name: str
    """The router's module name, e.g. `model.layers.0.mlp.gate`."""
    module: nn.Module
    top_k: int
    num_experts: int
    normalise: bool
    """Whether the router divides its top-k softmax weights by their sum."""


def moe_gates(model: nn.Module) -> list[MoeGate]:
    """Every MoE layer's router, in layer order.

    A router is a module with `top_k`, `num_experts` and a `[num_experts, hidden]` weight that
    sits next to an `experts` module: that finds them whatever the model class calls its layers.
    Only routers whose gate-weight rule is known are accepted, because replay must recompute
    exactly what the router would have given for the same experts.
    """
    gates = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not (
            isinstance(getattr(module, "top_k", None), int)
            and isinstance(getattr(module, "num_experts", None), int)
            and isinstance(weight, torch.Tensor)
            and weight.dim() == 2
            and weight.shape[0] == module.num_experts
        ):
            continue
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        if not hasattr(parent, "experts"):
            continue
        kind = type(module).__name__
        if kind in _NORMALISES_ALWAYS:
            normalise = True
        elif kind in _NORMALISES_BY_CONFIG:
            normalise = bool(module.norm_topk_prob)
        else:
            known = sorted(_NORMALISES_ALWAYS | _NORMALISES_BY_CONFIG)
            raise ConfigurationError(
                f"{name} of {type(model).__name__} is a {kind}, whose gate weights routing replay "
                f"does not know how to recompute; supported routers: {known}"
            )
        gates.append(MoeGate(name, module, module.top_k, module.num_experts, normalise))
    if not gates:
        raise ConfigurationError(
            f"{type(model).__name__} has no MoE router (a module with top_k, num_experts and a "
            "weight next to an `experts` module): routing record/replay needs an MoE base such "
            "as Qwen3-MoE or Mixtral"
        )
    return gates


class Routes:
    """The experts each token was routed to, filled in by `recording_routes`.

    Several forwards under one recording (a prefill, then decode steps) are concatenated along
    the sequence, so a generation's routes line up with its tokens.
    """

    def __init__(self, layers: int) -> None:
        self._calls: list[list[torch.Tensor]] = [[] for _ in range(layers)]

    def _add(self, layer: int, indices: torch.Tensor) -> None:
        self._calls[layer].append(indices)

    @property
    def indices(self) -> torch.Tensor:
        """`[batch, seq, layers, top_k]` expert indices (int64, on the CPU)."""
        if not self._calls[0]:
            raise ConfigurationError("no forward pass ran while recording routes")
        return torch.stack([torch.cat(calls, dim=1) for calls in self._calls], dim=2)

    def row(self, b: int) -> torch.Tensor:
        """`[seq, layers, top_k]`: the routes of batch row `b`."""
        return self.indices[b]


def _block_shape(gate: MoeGate, routed: torch.Tensor, shape: tuple[int, ...]) -> tuple[int, int]:
    """(batch, seq) of the block input that the router saw flattened to `[batch*seq, hidden]`."""
    if len(shape) != 3 or shape[0] * shape[1] != routed.shape[0]:
        raise ConfigurationError(
            f"{gate.name} routed {routed.shape[0]} tokens from a block input of shape "
            f"{shape}; routing record/replay expects a [batch, seq, hidden] block input"
        )
    return shape[0], shape[1]


RouterHook = Callable[[nn.Module, tuple, tuple], tuple | None]


@contextmanager
def _hooked(
    model: nn.Module,
    gates: list[MoeGate],
    hook_for: Callable[[int, MoeGate, Shapes], RouterHook],
) -> Iterator[None]:
    """Install `hook_for(layer, gate, shapes)` on every router; the block's input shape is
    captured by a pre-hook on its parent, since the router sees it already flattened."""
    shapes: Shapes = [() for _ in gates]
    handles = []

    def shape_hook(layer: int) -> Callable[[nn.Module, tuple], None]:
        def hook(_module: nn.Module, args: tuple) -> None:
            shapes[layer] = tuple(args[0].shape)

        return hook

    try:
        for layer, gate in enumerate(gates):
            parent = model.get_submodule(gate.name.rpartition(".")[0])
            handles.append(parent.register_forward_pre_hook(shape_hook(layer)))
            handles.append(gate.module.register_forward_hook(hook_for(layer, gate, shapes)))
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def recording_routes(model: nn.Module) -> Iterator[Routes]:
    """Record every MoE layer's top-k expert indices for the forwards run inside the block."""
    gates = moe_gates(model)
    routes = Routes(len(gates))

    def hook_for(layer: int, gate: MoeGate, shapes: Shapes) -> RouterHook:
        def hook(_module: nn.Module, _args: tuple, out: tuple) -> None:
            indices = out[2]
            batch, seq = _block_shape(gate, indices, shapes[layer])
            routes._add(layer, indices.detach().reshape(batch, seq, gate.top_k).cpu())

        return hook

    with _hooked(model, gates, hook_for):
        yield routes


def _check_routes(routes: torch.Tensor, gates: list[MoeGate]) -> None:
    """Refuse routes that do not fit the model: replaying them would silently mix experts."""
    expected = (len(gates), gates[0].top_k)
    if routes.dim() != 4 or tuple(routes.shape[2:]) != expected:
        raise ConfigurationError(
            f"routes of shape {tuple(routes.shape)} do not fit [batch, seq, layers, top_k] with "
            f"(layers, top_k) = {expected} for this model"
        )
    if routes.numel() and (routes.min() < 0 or routes.max() >= gates[0].num_experts):
        raise ConfigurationError(
            f"routes name experts {routes.min().item()}..{routes.max().item()}, outside "
            f"0..{gates[0].num_experts - 1}"
        )
    ordered = routes.sort(dim=-1).values
    if (ordered[..., 1:] == ordered[..., :-1]).any():
        raise ConfigurationError(
            "routes repeat an expert within one token's top-k; give padding positions distinct "
            "experts (e.g. arange(top_k))"
        )


@contextmanager
def replaying_routes(model: nn.Module, routes: Routes | torch.Tensor) -> Iterator[None]:
    """Route every token to the experts in `routes` (`[batch, seq, layers, top_k]`) instead of the
    router's choice, with the gate weights recomputed from the current router logits: softmax
    over all experts, gathered at the replayed ones, renormalised iff the router renormalises.

    Forwards inside the block consume the routes along the sequence (a prefill, then decode
    steps), so one replay covers a whole generation as well as a single scoring forward.
    """
    table = routes.indices if isinstance(routes, Routes) else routes
    gates = moe_gates(model)
    _check_routes(table, gates)
    cursor = [0 for _ in gates]

    def hook_for(layer: int, gate: MoeGate, shapes: Shapes) -> RouterHook:
        def hook(_module: nn.Module, _args: tuple, out: tuple) -> tuple:
            logits, scores, own = out
            batch, seq = _block_shape(gate, own, shapes[layer])
            start = cursor[layer]
            if batch != table.shape[0] or start + seq > table.shape[1]:
                raise ConfigurationError(
                    f"{gate.name} routed a [{batch}, {seq}] block at position {start}, beyond "
                    f"routes of shape {tuple(table.shape)}"
                )
            cursor[layer] = start + seq
            indices = table[:, start : start + seq, layer].reshape(-1, gate.top_k).to(own)
            weights = torch.softmax(logits.float(), dim=-1).gather(-1, indices)
            if gate.normalise:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(scores.dtype), indices

        return hook

    with _hooked(model, gates, hook_for):
        yield


def flip_rate(a: torch.Tensor, b: torch.Tensor) -> float:
    """The share of (token, layer) pairs whose top-k expert *set* differs between two routes of
    the same shape (`[..., layers, top_k]`); the order within a top-k does not matter."""
    if a.shape != b.shape:
        raise ConfigurationError(f"routes of shapes {tuple(a.shape)} and {tuple(b.shape)} differ")
    differs = (a.sort(dim=-1).values != b.to(a).sort(dim=-1).values).any(dim=-1)
    return differs.float().mean().item()
