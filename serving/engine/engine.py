"""The embedded torch engine: one resident base model, adapters in device slots beside it.

The engine owns its base model, any Hugging Face causal LM, and adapts it in place: every linear
layer an adapter may target (all of them, the output embedding included, by module name,
whatever the family calls them) is wrapped (`serving.engine.lora`), and so is every fused MoE
experts module, so a batch can mix adapters row by row, each row naming its device slot, slot 0
being the base alone.
Loading an adapter copies its LoRA pairs into a slot (the worker's residency plan says which);
the base weights are never touched.
`step` is one forward pass over a batch with its key/value cache, what the continuous-batching
scheduler runs; `generate` and `logits` run one static batch of plain prompts (tests,
benchmarks). Each takes the engine lock.
"""

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
from peft import LoraConfig, get_peft_config
from peft.utils.other import get_pattern_key
from transformers.cache_utils import DynamicCache

from mint_core.artifacts.freezing import check_finite
from mint_core.config import MintConfig
from mint_core.errors import ConfigurationError, IntegrityError, ServiceError
from mint_core.model.base import BaseModel, servable_modules
from mint_core.model.experts import ExpertTarget, expert_lora_targets, expert_stacks
from mint_core.model.generate import Generation, greedy_generate, pad_left
from mint_core.model.routing import Routes, moe_gates, recording_routes
from serving.engine.lora import BASE_SLOT, SlotBatch, lora_scaling, wrap_experts, wrap_linears

BASE = "__base__"
"""Adapter key of rows served by the base model alone."""
DEFAULT_SLOTS = MintConfig.device_slots
_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class AdapterWeights:
    """One adapter's LoRA pairs, checked against the base and ready to copy into a slot."""

    key: str
    pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor, float]]
    """Module name -> (A `[rank, in]`, B `[out, rank]`, scaling)."""
    experts: Mapping[str, Mapping[str, tuple[torch.Tensor, torch.Tensor, float]]] = field(
        default_factory=dict
    )
    """Experts module name -> fused parameter name -> (A `[experts, rank, in]`, B
    `[experts, out, rank]`, scaling)."""
    staged: torch.Tensor | None = None
    """One flat buffer in the base's dtype that every tensor above is a view of, laid out as
    the slots hold them (`A.T`, `B.T`, expert stacks as they are); pinned where the engine runs
    on a CUDA device, so that a slot load is one host-to-device copy at the link's speed
    instead of hundreds of small ones."""

    @property
    def nbytes(self) -> int:
        stacks = [stack for by_name in self.experts.values() for stack in by_name.values()]
        return sum(a.nbytes + b.nbytes for a, b, _ in [*self.pairs.values(), *stacks])


class TorchEngine:
    """Serves the base and any loaded adapters, on the CPU or a CUDA device."""

    def __init__(self, base: BaseModel, slots: int = DEFAULT_SLOTS) -> None:
        if slots < 1:
            raise ConfigurationError(f"slots={slots} must be at least 1")
        self.base = base
        self.codec = base.codec
        self.slots = slots
        self.batch = SlotBatch()
        # Slots 1..slots hold adapters (allocated when filled, for their own rank); slot 0,
        # the base, holds nothing.
        modules = servable_modules(base.model, output=True)
        self._wrappers = wrap_linears(base.model, modules, self.batch)
        self._experts = wrap_experts(base.model, self.batch)
        self._slot_of: dict[str, int] = {}
        self.lock = threading.Lock()
        """Held for each forward pass and each slot copy: a copy waits for at most one step."""
        if (output := base.model.get_output_embeddings()) is not None:
            output.register_forward_pre_hook(_dense_input)

    @property
    def device(self) -> torch.device:
        """Where the base runs: every tensor of a batch must be there."""
        return self.base.device

    @property
    def adapters(self) -> frozenset[str]:
        return frozenset(self._slot_of)

    def slot_of(self, key: str) -> int:
        """The device slot serving `key` (BASE_SLOT for the base)."""
        if key == BASE:
            return BASE_SLOT
        if key not in self._slot_of:
            raise ConfigurationError(f"adapter {key} is not loaded on this engine")
        return self._slot_of[key]

    def prepare(
        self, key: str, adapter_config: Mapping[str, object], tensors: Mapping[str, torch.Tensor]
    ) -> AdapterWeights:
        """Check adapter `key` (PEFT config and tensors) against the base: IntegrityError for
        tensors that do not fit, ConfigurationError for what is not plain LoRA or a tensor that
        is not finite (named: a bad value here would spoil every answer of the adapter)."""
        config = get_peft_config(dict(adapter_config))
        if not isinstance(config, LoraConfig) or config.use_dora:
            raise ConfigurationError(f"adapter {key} is not a plain LoRA adapter: {config}")
        for name, tensor in tensors.items():
            check_finite(name, tensor, f"adapter {key}")
        targets = expert_lora_targets(self.base.model, config.target_parameters)
        linear = {k: v for k, v in tensors.items() if _module_of(k)[0] not in targets}
        fused = {k: v for k, v in tensors.items() if _module_of(k)[0] in targets}
        experts: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor, float]]] = {}
        for target, (a, b, scaling) in self._expert_pairs(key, config, targets, fused).items():
            experts.setdefault(target.module, {})[target.parameter] = (a, b, scaling)
        return self._staged(key, self._pairs(key, config, linear), experts)

    def _staged(
        self,
        key: str,
        pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor, float]],
        experts: Mapping[str, Mapping[str, tuple[torch.Tensor, torch.Tensor, float]]],
    ) -> AdapterWeights:
        """`key`'s pairs and expert stacks copied into one flat host buffer (see
        `AdapterWeights.staged`), as views of it. Done once, off the request path."""
        # A linear slot holds A.T [in, rank] and B.T [rank, out], the batched matmuls' layout.
        stacks = [stack for by_name in experts.values() for stack in by_name.values()]
        slot_layout = [t for a, b, _ in pairs.values() for t in (a.T, b.T)]
        slot_layout += [t for a, b, _ in stacks for t in (a, b)]
        flat = torch.empty(
            sum(t.numel() for t in slot_layout),
            dtype=self.base.model.dtype,
            pin_memory=self.device.type == "cuda",
        )
        offset = 0

        def place(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal offset
            view = flat[offset : offset + tensor.numel()].view(tensor.shape).copy_(tensor)
            offset += tensor.numel()
            return view

        staged_pairs = {m: (place(a.T).T, place(b.T).T, s) for m, (a, b, s) in pairs.items()}
        staged_experts = {
            module: {name: (place(a), place(b), s) for name, (a, b, s) in by_name.items()}
            for module, by_name in experts.items()
        }
        return AdapterWeights(key, staged_pairs, staged_experts, flat)

    def load(self, weights: AdapterWeights, slot: int | None = None) -> int:
        """Copy an adapter into device slot `slot` (whatever held it is dropped), or into the
        first free slot; returns the slot. Loading a key already in a slot is a no-op."""
        with self.lock:
            if weights.key in self._slot_of and slot in (None, self._slot_of[weights.key]):
                return self._slot_of[weights.key]
            if slot is None:
                free = sorted(set(range(1, self.slots + 1)) - set(self._slot_of.values()))
                if not free:
                    raise ServiceError(
                        f"all {self.slots} device slots hold adapters; {weights.key} cannot "
                        "be loaded"
                    )
                slot = free[0]
            elif not 1 <= slot <= self.slots:
                raise ConfigurationError(f"slot {slot} is not one of 1..{self.slots}")
            self._slot_of = {
                k: s for k, s in self._slot_of.items() if s != slot and k != weights.key
            }
            on_device = _on_device(weights, self.device)
            for module, (a, b, scaling) in weights.pairs.items():
                self._wrappers[module].fill(slot, on_device(a.T), on_device(b.T), scaling)
            for module in self._wrappers.keys() - weights.pairs.keys():
                self._wrappers[module].clear(slot)
            for module, experts in self._experts.items():
                stacks = weights.experts.get(module, {}).items()
                experts.fill(slot, {n: (on_device(a), on_device(b), s) for n, (a, b, s) in stacks})
            self._slot_of[weights.key] = slot
            # The same rows may now mean different weights: gather them again.
            self.batch.reset()
            return slot

    def _pairs(
        self, key: str, config: LoraConfig, tensors: Mapping[str, torch.Tensor]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
        """module name -> (A, B, scaling), each checked against the module it adapts."""
        pairs = {}
        for module, pair in self._sides(key, tensors, self._wrappers.keys()).items():
            base = self._wrappers[module].base
            a, b = pair.get("A"), pair.get("B")
            if a is None or b is None or a.shape[1:] != (base.in_features,) or b.shape != (
                base.out_features, a.shape[0]):  # fmt: skip
                raise IntegrityError(
                    f"adapter {key} does not fit the base {self.base.model_id} "
                    f"({self.base.family}) at {module}: "
                    f"A {None if a is None else list(a.shape)}, B "
                    f"{None if b is None else list(b.shape)}, base projection "
                    f"{base.out_features}x{base.in_features}"
                )
            alpha_key = get_pattern_key(config.alpha_pattern.keys(), module)
            alpha = config.alpha_pattern.get(alpha_key, config.lora_alpha)
            pairs[module] = (a, b, lora_scaling(alpha, a.shape[0], config.use_rslora))
        return pairs

    def _expert_pairs(
        self,
        key: str,
        config: LoraConfig,
        targets: Mapping[str, ExpertTarget],
        tensors: Mapping[str, torch.Tensor],
    ) -> dict[ExpertTarget, tuple[torch.Tensor, torch.Tensor, float]]:
        """Fused expert parameter -> (A `[experts, rank, in]`, B `[experts, out, rank]`,
        scaling), each pair checked against the parameter it adapts (`tensors` are those saved
        under the PEFT keys of `targets`)."""
        stacks = {}
        for module, pair in self._sides(key, tensors, targets.keys()).items():
            target = targets[module]
            a, b = pair.get("A"), pair.get("B")
            if a is None or b is None or a.shape[1:] != (target.in_features,) or b.shape != (
                target.out_features, a.shape[0]) or a.shape[0] % target.experts:  # fmt: skip
                raise IntegrityError(
                    f"adapter {key} does not fit the base {self.base.model_id} "
                    f"({self.base.family}) at {target.module}.{target.parameter}: "
                    f"A {None if a is None else list(a.shape)}, B "
                    f"{None if b is None else list(b.shape)}, base experts "
                    f"{target.experts}x{target.out_features}x{target.in_features} (A must be "
                    "[rank*experts, in], B [out, rank*experts])"
                )
            a_stack, b_stack = expert_stacks(a, b, target.experts)
            # PEFT looks a fused parameter's alpha up by its unwrapped `module.parameter` name.
            name = f"{target.module}.{target.parameter}"
            alpha = config.alpha_pattern.get(
                get_pattern_key(config.alpha_pattern.keys(), name), config.lora_alpha
            )
            scaling = lora_scaling(alpha, a_stack.shape[1], config.use_rslora)
            stacks[target] = (a_stack, b_stack, scaling)
        return stacks

    def _sides(
        self, key: str, tensors: Mapping[str, torch.Tensor], modules: Iterable[str]
    ) -> dict[str, dict[str, torch.Tensor]]:
        """PEFT module key -> {"A": lora_A, "B": lora_B} of `tensors`; IntegrityError for a
        tensor that is not a LoRA pair of one of `modules`."""
        known = set(modules)
        sides: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in tensors.items():
            module, side = _module_of(name)
            if module not in known or side not in ("A.weight", "B.weight"):
                raise IntegrityError(
                    f"adapter {key} does not fit the base {self.base.model_id} "
                    f"({self.base.family}): tensor {name!r} is not a LoRA pair of one of its "
                    "linear layers or of the fused experts its target_parameters name "
                    "(input embeddings are not servable); the adapter was made for "
                    "another model"
                )
            sides.setdefault(module, {})[side[0]] = tensor
        return sides

    def unload(self, key: str) -> None:
        """Free adapter `key`'s device slot."""
        with self.lock:
            slot = self._slot_of.pop(key, None)
            if slot is not None:
                for wrapper in [*self._wrappers.values(), *self._experts.values()]:
                    wrapper.clear(slot)

    def generate(
        self, prompts: Sequence[str], adapter_keys: Sequence[str], max_new_tokens: int
    ) -> list[Generation]:
        """Greedy continuations of plain prompts; `adapter_keys[i]` (a loaded key or BASE)
        serves row i."""
        slots = [self.slot_of(key) for key in adapter_keys]
        ids = [self.codec.encode(prompt) for prompt in prompts]
        with self.lock, self.batch.rows(slots, self.device):
            return greedy_generate(self.base.model, self.codec, ids, max_new_tokens)

    @torch.inference_mode()
    def step(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        slots: list[int],
        cache: list[tuple[torch.Tensor, torch.Tensor]] | None,
        record_routes: bool = False,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]:
        """One forward pass: `input_ids` `[batch, new]` after `cache` (per layer, keys and values
        `[batch, heads, cached, dim]`, left-padded like `attention_mask` `[batch, cached + new]`),
        row i through device slot `slots[i]`. Returns the last position's logits `[batch, vocab]`,
        the cache extended by the new tokens, and with `record_routes` the experts each MoE
        layer routed each new position to, `[batch, new, layers, top_k]` on the CPU (else None:
        no hook runs then)."""
        position_ids = positions(attention_mask)[:, -input_ids.shape[1] :]
        with self.lock, self._recording(record_routes) as routes:
            self.batch.use(slots, input_ids.device)
            output = self.base.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=DynamicCache(ddp_cache_data=cache) if cache else None,
                use_cache=True,
                logits_to_keep=1,
            )
        extended = [(layer.keys, layer.values) for layer in output.past_key_values.layers]
        return output.logits[:, -1], extended, None if routes is None else routes.indices

    def _recording(self, on: bool) -> AbstractContextManager[Routes | None]:
        """Hooks on every MoE router for one forward while `on` (ConfigurationError on a base
        without any); nothing at all otherwise."""
        return recording_routes(self.base.model) if on else nullcontext()

    def check_routes(self) -> None:
        """ConfigurationError unless this base can record routes (it has MoE routers)."""
        moe_gates(self.base.model)

    @torch.inference_mode()
    def logits(self, prompts: Sequence[str], adapter_keys: Sequence[str]) -> torch.Tensor:
        """Next-token logits after each plain prompt, `[batch, vocab]`, one adapter per row."""
        rows = [self.codec.encode(prompt) for prompt in prompts]
        input_ids, attention_mask = (t.to(self.device) for t in pad_left(rows, self.codec.pad_id))
        slots = [self.slot_of(key) for key in adapter_keys]
        with self.lock, self.batch.rows(slots, self.device):
            output = self.base.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=positions(attention_mask),
                logits_to_keep=1,
            )
        return output.logits[:, -1]

    @torch.inference_mode()
    def prompt_logprobs(self, ids: Sequence[int], slot: int) -> list[float]:
        """log p(ids[i] | ids[:i]) of each token of one prompt through device slot `slot`;
        NaN for the first (nothing precedes it)."""
        input_ids = torch.tensor([list(ids)], device=self.device)
        with self.lock, self.batch.rows([slot], self.device):
            logits = self.base.model(input_ids=input_ids).logits[0, :-1]
        picked = torch.log_softmax(logits.float(), dim=-1).gather(-1, input_ids[0, 1:, None])
        return [float("nan"), *picked[:, 0].tolist()]


def _on_device(
    weights: AdapterWeights, device: torch.device
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Maps a view of `weights.staged` to the same view of its copy on `device`, made here in
    one copy (non-blocking from pinned memory: the forward passes that read it queue behind it
    on the same stream). Where the host is the device, the slots read the host tier's buffer
    itself: it never changes, and a copy would only double the memory."""
    staged = weights.staged
    if staged is None or staged.device == device:
        return lambda view: view
    copy = staged.to(device, non_blocking=staged.is_pinned())
    return lambda view: copy.as_strided(view.shape, view.stride(), view.storage_offset())


def _module_of(name: str) -> tuple[str, str]:
    """A PEFT tensor name's module key (without PEFT's prefix) and side (`A.weight`, ...)."""
    module, _, side = name.removeprefix(_PEFT_PREFIX).rpartition(".lora_")
    return module, side


def _dense_input(_: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The output embedding's input as a dense tensor. On the CPU, torch 2.13 takes a slow path
    for a bfloat16 linear over the strided one-row view that `logits_to_keep=1` passes (1-3 s
    for a 152k vocabulary instead of 0.03 s, measured by bench/sync.py); a dense copy of that
    row gives bit-identical logits."""
    return (args[0].contiguous(), *args[1:])


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of left-padded rows: each row counts from its own first real token, as if
    it ran alone."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)
