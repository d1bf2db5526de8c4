"""Many LoRA adapters in one batch, by gathered batched matmuls (Punica's and S-LoRA's idea).

Every linear layer of the resident base that an adapter may target is wrapped once. The wrapper
holds, per device slot in use, that adapter's pair in the layout the matmuls read, `A.T:
[in, rank]` and `B.T: [rank, out]`, sized for the adapter's own rank: views of the buffer the
engine staged the adapter in (on the CPU the host tier's own, on a CUDA device its one copy
there), taken when the slot is filled and dropped when it is cleared. A worker with 64 slots and
one adapter loaded holds one adapter's bytes, not 64 slots at the largest rank seen. Each batch
row names its slot; slot 0 (the base) holds nothing. A forward pass computes the base projection
for the whole batch and adds, per row, `scaling[row] * (x @ A.T[row]) @ B.T[row]` with two
batched matmuls over the rows.

The rows' pairs are gathered into contiguous per-row stacks (`[batch, in, rank]`, zero-padded to
the widest rank among the rows, zeros for rows whose slot does not adapt this layer: exact zeros
that change nothing) once per batch, at its first forward (the prefill), and reused at every
decode step: a step then reads each row's adapter once, as the base reads its weights. A layer
that no row's adapter targets is skipped. Per-row stacks beat one matmul per distinct adapter
when the adapters differ row by row (64 adapters in a batch of 64: measured here, 64 small
matmuls per layer cost several times the two batched ones).

A fused MoE experts module (PEFT's `target_parameters`) is wrapped likewise, with per-slot stacks
`A: [experts, rank, in]`, `B: [experts, out, rank]`, gathered per batch over the batch's distinct
slots; each token gets, for each expert it is routed to, that expert's delta from its row's slot.
"""

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from mint_core.errors import ConfigurationError
from mint_core.model.experts import EXPERT_PARAMETERS, experts_modules

BASE_SLOT = 0
_Module = TypeVar("_Module", bound=nn.Module)
_UNGATHERED = object()
Pair = tuple[torch.Tensor, torch.Tensor, float]


class SlotBatch:
    """The slot of each row in the batch being run; shared by every wrapper of one model."""

    def __init__(self) -> None:
        self.slot_ids: torch.Tensor | None = None
        """[batch] slot indices, or None when every row is served by the base alone."""
        self.gathered: dict[int, object] = {}
        """Per wrapper: its pairs gathered for this batch's rows (None: no row uses it)."""
        self._rows: list[int] = []

    @property
    def row_slots(self) -> list[int]:
        """The slot of each row, as a list."""
        return self._rows

    def use(self, slot_ids: list[int], device: torch.device) -> None:
        """Run the next forward passes with these rows; a change of rows drops the gathers."""
        if slot_ids == self._rows:
            return
        self._rows = list(slot_ids)
        self.gathered = {}
        # A batch of base rows skips the adapter path entirely (and its gathers).
        self.slot_ids = (
            torch.tensor(slot_ids, device=device) if any(s != BASE_SLOT for s in slot_ids) else None
        )

    def reset(self) -> None:
        """Forget the rows, so that slots refilled since are gathered afresh."""
        self.use([], torch.device("cpu"))

    @contextmanager
    def rows(self, slot_ids: list[int], device: torch.device) -> Iterator[None]:
        self.use(slot_ids, device)
        try:
            yield
        finally:
            self.reset()


def _padded(tensor: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
    """`tensor` zero-padded along its rank dimension `dim` to `rank` (itself when it has it)."""
    if tensor.shape[dim] == rank:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = rank
    wider = tensor.new_zeros(shape)
    wider.narrow(dim, 0, tensor.shape[dim]).copy_(tensor)
    return wider


class SlotLoraLinear(nn.Module):
    """A frozen base projection plus the per-row LoRA delta of each row's slot."""

    def __init__(self, base: nn.Linear, batch: SlotBatch) -> None:
        super().__init__()
        self.base = base
        self.batch = batch
        self.pairs: dict[int, Pair] = {}
        """Slot -> (A.T `[in, rank]`, B.T `[rank, out]`, scaling), only for slots that hold a
        pair for this layer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        slot_ids = self.batch.slot_ids
        if slot_ids is None or not self.pairs:
            return out
        gathered = self.batch.gathered.get(id(self), _UNGATHERED)
        if gathered is _UNGATHERED:
            gathered = self.batch.gathered[id(self)] = self._gather(self.batch.row_slots)
        if gathered is None:
            return out
        a_t, b_t, scaling = gathered  # type: ignore[misc]
        rows = x.reshape(slot_ids.shape[0], -1, x.shape[-1])  # [batch, tokens, in]
        delta = torch.bmm(torch.bmm(rows, a_t), b_t)  # [batch, tokens, out]
        return out + (delta * scaling).reshape(out.shape)

    def _gather(self, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The rows' pairs stacked, `[batch, in, rank]`, `[batch, rank, out]` and scalings
        `[batch, 1, 1]`; None when no row's slot holds a pair for this layer."""
        held = [self.pairs.get(slot) for slot in slots]
        rank = max((pair[0].shape[1] for pair in held if pair is not None), default=0)
        if rank == 0:
            return None
        weight = self.base.weight
        zero_a = weight.new_zeros(self.base.in_features, rank)
        zero_b = weight.new_zeros(rank, self.base.out_features)
        a_t = torch.stack([zero_a if p is None else _padded(p[0], 1, rank) for p in held])
        b_t = torch.stack([zero_b if p is None else _padded(p[1], 0, rank) for p in held])
        scalings = [0.0 if p is None else p[2] for p in held]
        scaling = torch.tensor(scalings, dtype=weight.dtype, device=weight.device)
        return a_t, b_t, scaling[:, None, None]

    def fill(self, slot: int, a_t: torch.Tensor, b_t: torch.Tensor, scaling: float) -> None:
        """Put one adapter's pair into `slot`, as the engine staged it on the device:
        `a_t` = A.T `[in, rank]`, `b_t` = B.T `[rank, out]`, contiguous, in the base's dtype."""
        self.pairs[slot] = (a_t, b_t, scaling)

    def clear(self, slot: int) -> None:
        self.pairs.pop(slot, None)


def wrap_linears(
    model: nn.Module, modules: Mapping[str, nn.Linear], batch: SlotBatch
) -> dict[str, SlotLoraLinear]:
    """Replace each of `modules` (linear layers of `model`, by module name as `named_modules`
    gives it) with a slot wrapper, in place; returns the wrappers by the same names."""
    return {
        name: _replace(model, name, SlotLoraLinear(linear, batch))
        for name, linear in modules.items()
    }


def _replace(model: nn.Module, name: str, module: _Module) -> _Module:
    """Put `module` in place of `model`'s submodule `name`; returns it."""
    parent_name, _, child_name = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child_name, module)
    return module


class SlotExpertLora(nn.Module):
    """The LoRA pairs of one fused expert parameter (`[experts, out, in]`) in the slots that
    hold one: per slot `A: [experts, rank, in]`, `B: [experts, out, rank]`."""

    def __init__(self, parameter: torch.Tensor) -> None:
        super().__init__()
        # The fused parameter gives dtype, device and shape; kept outside the module tree so
        # that it is not listed as a parameter of this module too.
        self.__dict__["like"] = parameter
        self.pairs: dict[int, Pair] = {}

    def gather(self, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The pairs of `slots` (a batch's distinct slots) stacked, `[len(slots), experts, rank,
        in]`, `[len(slots), experts, out, rank]`, with their scalings; zeros for a slot that
        holds none; None when none of them holds one."""
        held = [self.pairs.get(slot) for slot in slots]
        rank = max((pair[0].shape[1] for pair in held if pair is not None), default=0)
        if rank == 0:
            return None
        experts, out_features, in_features = self.like.shape
        zero_a = self.like.new_zeros(experts, rank, in_features)
        zero_b = self.like.new_zeros(experts, out_features, rank)
        a = torch.stack([zero_a if p is None else _padded(p[0], 1, rank) for p in held])
        b = torch.stack([zero_b if p is None else _padded(p[1], 2, rank) for p in held])
        scalings = [0.0 if p is None else p[2] for p in held]
        return a, b, torch.tensor(scalings, dtype=self.like.dtype, device=self.like.device)

    @staticmethod
    def delta(
        gathered: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        x: torch.Tensor,
        slots: torch.Tensor,
        expert: int,
    ) -> torch.Tensor:
        """`scaling * B @ (A @ x)` of `expert` for each token of `x` (`[tokens, in]`), through
        the pair of the token's slot (`slots`: `[tokens]`, indices into `gathered`'s stacks);
        `[tokens, out]`."""
        stack_a, stack_b, scaling = gathered
        a = stack_a[slots, expert]  # [tokens, rank, in]
        b = stack_b[slots, expert]  # [tokens, out, rank]
        return torch.bmm(b, torch.bmm(a, x[:, :, None]))[:, :, 0] * scaling[slots, None]

    def fill(self, slot: int, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        """Put one adapter's stacks (`a`: [experts, rank, in], `b`: [experts, out, rank]), as
        the engine staged them on the device, into `slot`."""
        self.pairs[slot] = (a, b, scaling)

    def clear(self, slot: int) -> None:
        self.pairs.pop(slot, None)


class SlotLoraExperts(nn.Module):
    """A fused experts module (`gate_up_proj [experts, 2*inter, hidden]`, `down_proj
    [experts, hidden, inter]`, as Qwen3-MoE and Mixtral hold them) plus, for each token and
    each expert it is routed to, that expert's LoRA delta in the token's row slot: on
    `gate_up_proj` before the activation, on `down_proj` after it."""

    def __init__(self, experts: nn.Module, batch: SlotBatch) -> None:
        super().__init__()
        layout = {"has_bias": False, "is_concatenated": True, "has_post_expert_norm": False}
        if any(getattr(experts, flag, value) != value for flag, value in layout.items()):
            raise ConfigurationError(
                f"{type(experts).__name__} is not laid out as {layout}; the engine serves expert "
                "LoRA only on transformers' Qwen3-MoE / Mixtral experts"
            )
        # The wrapper takes the experts' place and their parameters under the same names, so
        # that the model's parameter names, and PEFT's key rule for them
        # (mint_core.model.experts), stay the base's. The original module, which runs batches
        # of base rows, stays outside the module tree so its parameters are not listed twice.
        self.__dict__["base"] = experts
        self.gate_up_proj = experts.gate_up_proj
        self.down_proj = experts.down_proj
        self.batch = batch
        self.lora = nn.ModuleDict(
            {name: SlotExpertLora(getattr(experts, name)) for name in EXPERT_PARAMETERS}
        )

    def _gathered(self) -> tuple[torch.Tensor, dict[str, object]]:
        """Each row's index into this batch's distinct slots, and per fused parameter its
        pairs gathered over them (None: no row's slot adapts it); once per batch."""
        gathered = self.batch.gathered.get(id(self))
        if gathered is None:
            rows = self.batch.row_slots
            distinct = sorted(set(rows))
            index = {slot: i for i, slot in enumerate(distinct)}
            local = torch.tensor([index[s] for s in rows], device=self.gate_up_proj.device)
            stacks = {name: lora.gather(distinct) for name, lora in self.lora.items()}
            gathered = self.batch.gathered[id(self)] = (local, stacks)
        return gathered  # type: ignore[return-value]

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        slot_ids = self.batch.slot_ids
        if slot_ids is None or not any(lora.pairs for lora in self.lora.values()):
            return self.base(hidden_states, top_k_index, top_k_weights)
        local, stacks = self._gathered()
        gate_up_lora, down_lora = stacks["gate_up_proj"], stacks["down_proj"]
        if gate_up_lora is None and down_lora is None:
            return self.base(hidden_states, top_k_index, top_k_weights)
        # `hidden_states` is the batch flattened row by row: [rows * tokens, hidden].
        token_slots = local.repeat_interleave(hidden_states.shape[0] // slot_ids.shape[0])
        # transformers' eager loop (Qwen3MoeExperts.forward) step for step, so that the tokens
        # of rows in slot 0 (all zeros) get the base's bits.
        experts = self.gate_up_proj.shape[0]
        final = torch.zeros_like(hidden_states)
        expert_mask = F.one_hot(top_k_index, num_classes=experts + 1).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert in expert_hit[:, 0].tolist():
            if expert == experts:
                continue
            top_k_pos, token_idx = torch.where(expert_mask[expert])
            x, slots = hidden_states[token_idx], token_slots[token_idx]
            gate_up = F.linear(x, self.gate_up_proj[expert])
            if gate_up_lora is not None:
                gate_up = gate_up + SlotExpertLora.delta(gate_up_lora, x, slots, expert)  # type: ignore[arg-type]
            gate, up = gate_up.chunk(2, -1)
            inner = self.base.act_fn(gate) * up
            out = F.linear(inner, self.down_proj[expert])
            if down_lora is not None:
                out = out + SlotExpertLora.delta(down_lora, inner, slots, expert)  # type: ignore[arg-type]
            out = out * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, out.to(final.dtype))
        return final

    def fill(
        self, slot: int, stacks: Mapping[str, tuple[torch.Tensor, torch.Tensor, float]]
    ) -> None:
        """Put one adapter's stacks (parameter name -> (A, B, scaling)) into `slot`; the
        parameters it does not adapt hold nothing there."""
        for name, lora in self.lora.items():
            if name in stacks:
                lora.fill(slot, *stacks[name])
            else:
                lora.clear(slot)

    def clear(self, slot: int) -> None:
        for lora in self.lora.values():
            lora.clear(slot)


def wrap_experts(model: nn.Module, batch: SlotBatch) -> dict[str, SlotLoraExperts]:
    """Replace every fused experts module of `model` with a slot wrapper, in place; returns
    the wrappers by module name."""
    return {
        name: _replace(model, name, SlotLoraExperts(experts, batch))
        for name, experts in experts_modules(model).items()
    }


def lora_scaling(alpha: float, rank: int, use_rslora: bool) -> float:
    """PEFT's scaling of a LoRA pair: alpha / rank, or alpha / sqrt(rank) for rsLoRA."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank
