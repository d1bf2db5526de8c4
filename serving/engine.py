"""The embedded torch engine: one resident base model, adapters loaded beside it.

Adapters are held as named PEFT LoRA adapters on one shared copy of the base, and a batch can
mix them row by row (PEFT's `adapter_names`), with `BASE` for rows that want the base alone.
Loading and generating take one lock: PEFT mutates the module tree when it adds an adapter.
"""

import threading
from collections.abc import Mapping, Sequence

import torch
from peft import PeftModel, get_peft_config, set_peft_model_state_dict

from mint_core.base_model import BaseModel
from mint_core.errors import ConfigurationError, IntegrityError
from mint_core.textgen import Generation, greedy_generate
from mint_core.tokenizer import CharTokenizer

BASE = "__base__"
"""Adapter key of rows served by the base model alone (PEFT's own sentinel)."""
WARMUP_PROMPT = "warm="


class TorchEngine:
    """Serves the base and any loaded adapters, on the CPU or a CUDA device."""

    def __init__(self, base: BaseModel) -> None:
        self.base = base
        self.tokenizer = CharTokenizer()
        self._model: torch.nn.Module = base.model
        self._adapters: set[str] = set()
        self._lock = threading.Lock()

    @property
    def adapters(self) -> frozenset[str]:
        return frozenset(self._adapters)

    def load(
        self, key: str, adapter_config: Mapping[str, object], tensors: dict[str, torch.Tensor]
    ) -> None:
        """Add adapter `key` from its PEFT config and tensors. Idempotent per key."""
        if key in self._adapters:
            return
        config = get_peft_config(dict(adapter_config))
        with self._lock:
            if isinstance(self._model, PeftModel):
                self._model.add_adapter(key, config)
            else:
                self._model = PeftModel(self._model, config, adapter_name=key)
            result = set_peft_model_state_dict(self._model, tensors, adapter_name=key)
            lora_unexpected = [k for k in result.unexpected_keys if "lora_" in k]
            missing = [k for k in result.missing_keys if "lora_" in k and f".{key}." in k]
            if lora_unexpected or missing:
                self._model.delete_adapter(key)
                raise IntegrityError(
                    f"adapter {key} does not fit the base {self.base.model_id}: unexpected "
                    f"tensors {lora_unexpected[:3]}, missing {missing[:3]}"
                )
            self._model.eval()
            self._adapters.add(key)

    def generate(
        self, prompts: Sequence[str], adapter_keys: Sequence[str], max_new_tokens: int
    ) -> list[Generation]:
        """Greedy continuations; `adapter_keys[i]` (a loaded key or BASE) serves row i."""
        unknown = sorted({k for k in adapter_keys if k != BASE and k not in self._adapters})
        if unknown:
            raise ConfigurationError(f"adapters {unknown} are not loaded on this engine")
        with self._lock:
            if isinstance(self._model, PeftModel):
                return greedy_generate(
                    self._model,
                    self.tokenizer,
                    prompts,
                    max_new_tokens,
                    adapter_names=list(adapter_keys),
                )
            return greedy_generate(self._model, self.tokenizer, prompts, max_new_tokens)

    def warm_up(self, key: str) -> Generation:
        """A forward pass through adapter `key`, so its first request pays no first-use cost."""
        return self.generate([WARMUP_PROMPT], [key], max_new_tokens=2)[0]
