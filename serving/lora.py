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
"""

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

BASE_SLOT = 0


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
        slots, old, _ = self.lora_A.shape
        wider_a = self.lora_A.new_zeros(slots, rank, self.lora_A.shape[2])
        wider_a[:, :old] = self.lora_A
        wider_b = self.lora_Bt.new_zeros(slots, rank, self.lora_Bt.shape[2])
        wider_b[:, :old] = self.lora_Bt
        self.lora_A, self.lora_Bt = wider_a, wider_b


def wrap_linears(
    model: nn.Module, modules: Mapping[str, nn.Linear], slots: int, batch: SlotBatch
) -> dict[str, SlotLoraLinear]:
    """Replace each of `modules` (linear layers of `model`, by module name as `named_modules`
    gives it) with a slot wrapper, in place; returns the wrappers by the same names."""
    wrappers: dict[str, SlotLoraLinear] = {}
    for name, linear in modules.items():
        parent_name, _, child_name = name.rpartition(".")
        wrapper = SlotLoraLinear(linear, slots, batch)
        setattr(model.get_submodule(parent_name), child_name, wrapper)
        wrappers[name] = wrapper
    return wrappers


def lora_scaling(alpha: float, rank: int, use_rslora: bool) -> float:
    """PEFT's scaling of a LoRA pair: alpha / rank, or alpha / sqrt(rank) for rsLoRA."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank
