"""The embedded torch engine: one resident base model, adapters in device slots beside it.

The engine owns its base model and adapts it in place: every attention and MLP projection is
wrapped (`serving.lora`) so a batch can mix adapters row by row, each row naming its device
slot, slot 0 being the base alone. Loading an adapter copies its LoRA pairs into a free slot;
the base weights are never touched. Loading and generating take one lock.
"""

import threading
from collections.abc import Mapping, Sequence

import torch
from peft import LoraConfig, get_peft_config
from peft.utils.other import get_pattern_key

from mint_core.base_model import BaseModel
from mint_core.errors import ConfigurationError, IntegrityError, ServiceError
from mint_core.textgen import Generation, greedy_generate, left_padded
from mint_core.tokenizer import CharTokenizer
from mint_core.training import ALL_PROJECTIONS
from serving.lora import BASE_SLOT, SlotBatch, lora_scaling, wrap_projections

BASE = "__base__"
"""Adapter key of rows served by the base model alone."""
WARMUP_PROMPT = "warm="
DEFAULT_SLOTS = 64
_PEFT_PREFIX = "base_model.model."


class TorchEngine:
    """Serves the base and any loaded adapters, on the CPU or a CUDA device."""

    def __init__(self, base: BaseModel, slots: int = DEFAULT_SLOTS) -> None:
        if slots < 1:
            raise ConfigurationError(f"slots={slots} must be at least 1")
        self.base = base
        self.tokenizer = CharTokenizer()
        self.slots = slots
        self._batch = SlotBatch()
        # One slot more than adapters: slot 0 stays all zeros for base rows.
        self._wrappers = wrap_projections(base.model, ALL_PROJECTIONS, slots + 1, self._batch)
        self._slot_of: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def adapters(self) -> frozenset[str]:
        return frozenset(self._slot_of)

    def load(
        self, key: str, adapter_config: Mapping[str, object], tensors: dict[str, torch.Tensor]
    ) -> None:
        """Put adapter `key` (PEFT config and tensors) into a free device slot. Idempotent."""
        if key in self._slot_of:
            return
        config = get_peft_config(dict(adapter_config))
        if not isinstance(config, LoraConfig) or config.use_dora:
            raise ConfigurationError(f"adapter {key} is not a plain LoRA adapter: {config}")
        pairs = self._pairs(key, config, tensors)
        with self._lock:
            free = sorted(set(range(1, self.slots + 1)) - set(self._slot_of.values()))
            if not free:
                raise ServiceError(
                    f"all {self.slots} device slots hold adapters; {key} cannot be loaded"
                )
            for module, (a, b, scaling) in pairs.items():
                self._wrappers[module].fill(free[0], a, b, scaling)
            self._slot_of[key] = free[0]

    def _pairs(
        self, key: str, config: LoraConfig, tensors: Mapping[str, torch.Tensor]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
        """module name -> (A, B, scaling), each checked against the module it adapts."""
        sides: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in tensors.items():
            module, _, side = name.removeprefix(_PEFT_PREFIX).rpartition(".lora_")
            if module not in self._wrappers or side not in ("A.weight", "B.weight"):
                raise IntegrityError(
                    f"adapter {key} does not fit the base {self.base.model_id}: unexpected "
                    f"tensor {name!r} (adapted projections: {', '.join(ALL_PROJECTIONS)})"
                )
            sides.setdefault(module, {})[side[0]] = tensor
        pairs = {}
        for module, pair in sides.items():
            base = self._wrappers[module].base
            a, b = pair.get("A"), pair.get("B")
            if a is None or b is None or a.shape[1:] != (base.in_features,) or b.shape != (
                base.out_features, a.shape[0]):  # fmt: skip
                raise IntegrityError(
                    f"adapter {key} does not fit the base {self.base.model_id} at {module}: "
                    f"A {None if a is None else list(a.shape)}, B "
                    f"{None if b is None else list(b.shape)}, base projection "
                    f"{base.out_features}x{base.in_features}"
                )
            alpha_key = get_pattern_key(config.alpha_pattern.keys(), module)
            alpha = config.alpha_pattern.get(alpha_key, config.lora_alpha)
            pairs[module] = (a, b, lora_scaling(alpha, a.shape[0], config.use_rslora))
        return pairs

    def unload(self, key: str) -> None:
        """Free adapter `key`'s device slot."""
        with self._lock:
            slot = self._slot_of.pop(key, None)
            if slot is not None:
                for wrapper in self._wrappers.values():
                    wrapper.clear(slot)

    def generate(
        self, prompts: Sequence[str], adapter_keys: Sequence[str], max_new_tokens: int
    ) -> list[Generation]:
        """Greedy continuations; `adapter_keys[i]` (a loaded key or BASE) serves row i."""
        device = next(self.base.model.parameters()).device
        with self._lock, self._batch.rows(self._slots(adapter_keys), device):
            return greedy_generate(self.base.model, self.tokenizer, prompts, max_new_tokens)

    def _slots(self, adapter_keys: Sequence[str]) -> list[int]:
        unknown = sorted({k for k in adapter_keys if k != BASE and k not in self._slot_of})
        if unknown:
            raise ConfigurationError(f"adapters {unknown} are not loaded on this engine")
        return [BASE_SLOT if k == BASE else self._slot_of[k] for k in adapter_keys]

    @torch.inference_mode()
    def logits(self, prompts: Sequence[str], adapter_keys: Sequence[str]) -> torch.Tensor:
        """Next-token logits after each prompt, `[batch, vocab]`, one adapter per row."""
        input_ids, attention_mask = left_padded(self.tokenizer, prompts)
        with self._lock, self._batch.rows(self._slots(adapter_keys), input_ids.device):
            return self.base.model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -1]

    def warm_up(self, key: str) -> Generation:
        """A forward pass through adapter `key`, so its first request pays no first-use cost."""
        return self.generate([WARMUP_PROMPT], [key], max_new_tokens=2)[0]
