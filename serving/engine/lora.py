"""Many LoRA adapters in one batch, by gathered batched matmuls (Punica's and S-LoRA's idea).

Every linear layer of the resident base that an adapter may target is wrapped once. The wrapper
keeps the adapters' weights stacked in device slots, `A: [slots, rank_max, in]` and `B`
transposed, `Bt: [slots, rank_max, out]`, and each batch row names its slot. A forward pass
computes the base projection for the whole batch and adds, per row,
`scaling[slot] * (x @ A[slot].T) @ Bt[slot]` with two batched matmuls over the rows' slots.
Slot 0 is all zeros: the base alone. Adapters of lower rank are zero-padded to `rank_max`,
which adds exact zeros and so changes nothing.

The rows' slots are gathered into contiguous per-row stacks once per batch, at its first forward
(the prefill), and reused at every decode step: a step then reads each row's adapter once, as
the base reads its weights, instead of copying them again.

A fused MoE experts module (PEFT's `target_parameters`) is wrapped likewise, with stacks per
slot and expert, `A: [slots, experts, rank_max, in]`, `B: [slots, experts, out, rank_max]`;
each token gets, for each expert it is routed to, that expert's delta from its row's slot.
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


class SlotBatch:
    """The slot of each row in the batch being run; shared by every wrapper of one model."""

    def __init__(self) -> None:
        self.slot_ids: torch.Tensor | None = None
        """[batch] slot indices, or None when every row is served by the base alone."""
        self.gathered: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        """Per wrapper: its slots gathered for this batch's rows (A.T, Bt, scaling)."""
        self._rows: list[int] = []

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


class SlotLoraLinear(nn.Module):
    """A frozen base projection plus the per-row LoRA delta of each row's slot."""

    def __init__(self, base: nn.Linear, slots: int, batch: SlotBatch) -> None:
        super().__init__()
        self.base = base
        self.batch = batch
        like = {"dtype": base.weight.dtype, "device": base.weight.device}
        self.register_buffer("lora_A", torch.zeros(slots, 0, base.in_features, **like), False)
        self.register_buffer("lora_Bt", torch.zeros(slots, 0, base.out_features, **like), False)
        self.register_buffer("scaling", torch.zeros(slots, **like), False)

    @property
    def rank_max(self) -> int:
        return self.lora_A.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        slot_ids = self.batch.slot_ids
        if slot_ids is None or self.rank_max == 0:
            return out
        gathered = self.batch.gathered.get(id(self))
        if gathered is None:
            gathered = self.batch.gathered[id(self)] = (
                self.lora_A.index_select(0, slot_ids).transpose(1, 2),  # [batch, in, rank]
                self.lora_Bt.index_select(0, slot_ids),  # [batch, rank, out]
                self.scaling.index_select(0, slot_ids)[:, None, None],
            )
        a_t, b_t, scaling = gathered
        rows = x.reshape(slot_ids.shape[0], -1, x.shape[-1])  # [batch, tokens, in]
        delta = torch.bmm(torch.bmm(rows, a_t), b_t)  # [batch, tokens, out]
        return out + (delta * scaling).reshape(out.shape)

    def fill(self, slot: int, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        """Put one adapter's pair (`a`: [rank, in], `b`: [out, rank]) into `slot`."""
        rank = a.shape[0]
        if rank > self.rank_max:
            self._grow(rank)
        self.clear(slot)
        self.lora_A[slot, :rank].copy_(a)
        self.lora_Bt[slot, :rank].copy_(b.T)
        self.scaling[slot] = scaling

    def clear(self, slot: int) -> None:
        self.lora_A[slot].zero_()
        self.lora_Bt[slot].zero_()
        self.scaling[slot] = 0.0

    def _grow(self, rank: int) -> None:
        """Widen every slot to `rank` (at load time, never during a batch)."""
        self.lora_A, self.lora_Bt = _widened(self.lora_A, 1, rank), _widened(self.lora_Bt, 1, rank)


def _widened(stack: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
    """`stack` zero-padded along its rank dimension `dim` to `rank`."""
    shape = list(stack.shape)
    shape[dim] = rank
    wider = stack.new_zeros(shape)
    wider.narrow(dim, 0, stack.shape[dim]).copy_(stack)
    return wider


def wrap_linears(
    model: nn.Module, modules: Mapping[str, nn.Linear], slots: int, batch: SlotBatch
) -> dict[str, SlotLoraLinear]:
    """Replace each of `modules` (linear layers of `model`, by module name as `named_modules`
    gives it) with a slot wrapper, in place; returns the wrappers by the same names."""
    return {
        name: _replace(model, name, SlotLoraLinear(linear, slots, batch))
        for name, linear in modules.items()
    }


def _replace(model: nn.Module, name: str, module: _Module) -> _Module:
    """Put `module` in place of `model`'s submodule `name`; returns it."""
    parent_name, _, child_name = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child_name, module)
    return module


class SlotExpertLora(nn.Module):
    """The LoRA pairs of one fused expert parameter (`[experts, out, in]`) in every slot:
    `A: [slots, experts, rank_max, in]`, `B: [slots, experts, out, rank_max]`."""

    def __init__(self, parameter: torch.Tensor, slots: int) -> None:
        super().__init__()
        experts, out_features, in_features = parameter.shape
        like = {"dtype": parameter.dtype, "device": parameter.device}
        self.register_buffer("lora_A", torch.zeros(slots, experts, 0, in_features, **like), False)
        self.register_buffer("lora_B", torch.zeros(slots, experts, out_features, 0, **like), False)
        self.register_buffer("scaling", torch.zeros(slots, **like), False)

    @property
    def rank_max(self) -> int:
        return self.lora_A.shape[2]

    def delta(self, x: torch.Tensor, slots: torch.Tensor, expert: int) -> torch.Tensor:
        """`scaling * B @ (A @ x)` of `expert` for each token of `x` (`[tokens, in]`), through
        the pair in the token's slot (`slots`: `[tokens]`); `[tokens, out]`."""
        a = self.lora_A[slots, expert]  # [tokens, rank, in]
        b = self.lora_B[slots, expert]  # [tokens, out, rank]
        return torch.bmm(b, torch.bmm(a, x[:, :, None]))[:, :, 0] * self.scaling[slots, None]

    def fill(self, slot: int, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        """Put one adapter's stacks (`a`: [experts, rank, in], `b`: [experts, out, rank]) into
        `slot`."""
        rank = a.shape[1]
        if rank > self.rank_max:
            self.lora_A = _widened(self.lora_A, 2, rank)
            self.lora_B = _widened(self.lora_B, 3, rank)
        self.clear(slot)
        self.lora_A[slot, :, :rank].copy_(a)
        self.lora_B[slot, :, :, :rank].copy_(b)
        self.scaling[slot] = scaling

    def clear(self, slot: int) -> None:
        self.lora_A[slot].zero_()
        self.lora_B[slot].zero_()
        self.scaling[slot] = 0.0


class SlotLoraExperts(nn.Module):
    """A fused experts module (`gate_up_proj [experts, 2*inter, hidden]`, `down_proj
    [experts, hidden, inter]`, as Qwen3-MoE and Mixtral hold them) plus, for each token and
    each expert it is routed to, that expert's LoRA delta in the token's row slot: on
    `gate_up_proj` before the activation, on `down_proj` after it."""

    def __init__(self, experts: nn.Module, slots: int, batch: SlotBatch) -> None:
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
            {name: SlotExpertLora(getattr(experts, name), slots) for name in EXPERT_PARAMETERS}
        )

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        slot_ids = self.batch.slot_ids
        if slot_ids is None or all(lora.rank_max == 0 for lora in self.lora.values()):
            return self.base(hidden_states, top_k_index, top_k_weights)
        # `hidden_states` is the batch flattened row by row: [rows * tokens, hidden].
        token_slots = slot_ids.repeat_interleave(hidden_states.shape[0] // slot_ids.shape[0])
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
            gate, up = (gate_up + self.lora["gate_up_proj"].delta(x, slots, expert)).chunk(2, -1)
            inner = self.base.act_fn(gate) * up
            out = F.linear(inner, self.down_proj[expert])
            out = out + self.lora["down_proj"].delta(inner, slots, expert)
            out = out * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, out.to(final.dtype))
        return final

    def fill(
        self, slot: int, stacks: Mapping[str, tuple[torch.Tensor, torch.Tensor, float]]
    ) -> None:
        """Put one adapter's stacks (parameter name -> (A, B, scaling)) into `slot`; the
        parameters it does not adapt get zeros there."""
        for name, lora in self.lora.items():
            if name in stacks:
                lora.fill(slot, *stacks[name])
            else:
                lora.clear(slot)

    def clear(self, slot: int) -> None:
        for lora in self.lora.values():
            lora.clear(slot)


def wrap_experts(model: nn.Module, slots: int, batch: SlotBatch) -> dict[str, SlotLoraExperts]:
    """Replace every fused experts module of `model` with a slot wrapper, in place; returns
    the wrappers by module name."""
    return {
        name: _replace(model, name, SlotLoraExperts(experts, slots, batch))
        for name, experts in experts_modules(model).items()
    }


def lora_scaling(alpha: float, rank: int, use_rslora: bool) -> float:
    """PEFT's scaling of a LoRA pair: alpha / rank, or alpha / sqrt(rank) for rsLoRA."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank
