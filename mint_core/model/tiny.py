"""The embedded default base: a tiny Llama built from config, pretrained for seconds, and saved
as an ordinary Hugging Face model folder (weights, `tokenizer.json` with a chat template,
`generation_config.json`) under `MINT_HOME/base/`. From then on it is loaded exactly like a
user's model (`mint_core.model.base`); nothing else knows it is tiny.

The tokenizer is byte-level with one token per byte (no merges), so every UTF-8 text has a
tokenization, multi-byte characters span several tokens, and a task such as reversing a word is
learnable letter by letter. Tests build tiny members of other families with the same tokenizer
(`save_base_folder`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mint_core.artifacts.folders import publish_folder
from mint_core.errors import ConfigurationError
from mint_core.model.toy import Task, training_stream

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

PAD, BOS, EOS, IM_START, IM_END = "<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, IM_START, IM_END)
"""Ids 0-4; the 256 byte tokens follow."""
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML, as Qwen's bases use it; an assistant turn ends with `<|im_end|>`."""


@dataclass(frozen=True)
class TinySpec:
    """Everything that determines the embedded default's weights: same spec, same bytes."""

    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 4
    """Decoder layers."""
    num_heads: int = 4
    """Attention heads (also key/value heads: no grouped-query attention at this size)."""
    intermediate_size: int = 256
    """Width of each MLP's hidden layer."""
    context_length: int = 128
    """Longest sequence (prompt + answer) the model serves."""
    seed: int = 0
    """Seeds initialisation and the pretraining data stream."""
    pretrain_steps: int = 250
    """Steps of `echo` pretraining; 0 leaves the random initialisation."""
    pretrain_batch_size: int = 64
    """Examples per pretraining step."""
    pretrain_learning_rate: float = 3e-3
    """Peak AdamW learning rate of pretraining."""
    num_experts: int = 0
    """0: a dense Llama. More: a Qwen3-MoE whose every MLP is this many experts of
    `intermediate_size`, `experts_per_token` of them per token (top-k weights renormalised, as
    Qwen3-30B-A3B does)."""
    experts_per_token: int = 2

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise ConfigurationError(f"tiny base {name}={getattr(self, name)} must be > 0")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ConfigurationError(
                f"tiny base experts_per_token={self.experts_per_token} must be in "
                f"1..num_experts={self.num_experts}"
            )
        if self.hidden_size % self.num_heads:
            raise ConfigurationError(
                f"tiny base hidden_size={self.hidden_size} is not divisible by "
                f"num_heads={self.num_heads}; pick sizes that divide"
            )

    @property
    def name(self) -> str:
        """The folder name, and so the model id: a content key of the spec."""
        fields = asdict(self)
        if not self.num_experts:  # dense bases keep the names they had before MoE specs
            del fields["num_experts"], fields["experts_per_token"]
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
        return f"mint-tiny-{'qwen3-moe' if self.num_experts else 'llama'}-{digest}"

    def model_config(self) -> PreTrainedConfig:
        from transformers import LlamaConfig, Qwen3MoeConfig

        if self.num_experts:
            return Qwen3MoeConfig(
                vocab_size=len(SPECIAL_TOKENS) + 256,
                hidden_size=self.hidden_size,
                moe_intermediate_size=self.intermediate_size,
                num_experts=self.num_experts,
                num_experts_per_tok=self.experts_per_token,
                norm_topk_prob=True,
                num_hidden_layers=self.num_layers,
                num_attention_heads=self.num_heads,
                num_key_value_heads=self.num_heads,
                head_dim=self.hidden_size // self.num_heads,
                max_position_embeddings=self.context_length,
                tie_word_embeddings=True,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
            )
        return LlamaConfig(
            vocab_size=len(SPECIAL_TOKENS) + 256,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_heads,
            max_position_embeddings=self.context_length,
            tie_word_embeddings=True,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer, one token per byte, with BOS added and a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for byte_char in sorted(ByteLevel.alphabet()):
        vocab[byte_char] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 1)]
    )
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=BOS, eos_token=EOS, pad_token=PAD
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_base_folder(model: PreTrainedModel, folder: Path) -> None:
    """Save `model` with the byte tokenizer and a generation config that ends at `</s>` or
    `<|im_end|>`, as a model folder any Hugging Face loader reads."""
    from transformers import GenerationConfig

    tokenizer = byte_tokenizer()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)],
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def ensure_tiny(
    spec: TinySpec, root: Path, progress: Callable[[int, int], None] | None = None
) -> Path:
    """The folder of `spec`'s model under `root`, built and pretrained first if missing;
    `progress(step, total)` after each pretraining step (seconds to minutes: a bar's worth)."""
    folder = root / spec.name
    if not (folder / "config.json").exists():
        model = _pretrain(spec, progress)
        # Atomic: a crash or a concurrent builder never leaves half a base.
        with publish_folder(folder, prefix=f".{spec.name}-") as staging:
            save_base_folder(model, staging)
            (staging / "mint-spec.json").write_text(json.dumps(asdict(spec), indent=2))
    return folder


def _pretrain(
    spec: TinySpec, progress: Callable[[int, int], None] | None = None
) -> PreTrainedModel:
    import torch
    from transformers import AutoModelForCausalLM

    from mint_core.model.datasets import collate, tokenize_example
    from mint_core.model.generate import seeded
    from mint_core.model.text import TextCodec

    with seeded(spec.seed):
        model = AutoModelForCausalLM.from_config(spec.model_config())
    if spec.pretrain_steps == 0:
        return model
    codec = TextCodec(byte_tokenizer(), None, spec.name)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.pretrain_learning_rate)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=spec.pretrain_learning_rate, total_steps=spec.pretrain_steps
    )
    stream = training_stream(Task.ECHO, spec.seed, mixed_case=True)
    for step in range(1, spec.pretrain_steps + 1):
        rows = [next(stream) for _ in range(spec.pretrain_batch_size)]
        batch = collate([tokenize_example(codec, r.prompt, r.completion) for r in rows], codec)
        model(**batch).loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if progress is not None:
            progress(step, spec.pretrain_steps)
    model.eval()
    return model
