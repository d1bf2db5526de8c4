"""A base model's text side, done as serving engines do it: the model's own tokenizer, its chat
template, every end-of-sequence id of its generation config, and incremental detokenization
that is right for byte-level BPE (a streamed answer's pieces concatenate to exactly the whole
answer's text, multi-byte characters included)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from mint_core.errors import ConfigurationError

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedTokenizerBase

Message = Mapping[str, str]
"""One chat turn: `{"role": ..., "content": ...}`."""

_INCOMPLETE = "\ufffd"
"""What a byte-level decode yields for a character whose bytes have not all arrived yet."""


class TextCodec:
    """Text in and out of one base model."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        generation_config: GenerationConfig | None,
        model_id: str,
    ) -> None:
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.eos_ids = _eos_ids(tokenizer, generation_config)
        """Every token id that ends a generation: the generation config's and the
        tokenizer's own."""
        pad = tokenizer.pad_token_id
        # Padding is masked out, so any id does; many bases (Llama) define none.
        self.pad_id: int = pad if pad is not None else min(self.eos_ids)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.tokenizer.chat_template)

    def encode(self, prompt: str) -> list[int]:
        """A completion prompt's token ids, with the special tokens the tokenizer adds (BOS)."""
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def encode_answer(self, completion: str) -> list[int]:
        """The token ids of text that follows a prompt, then end-of-sequence (for training)."""
        ids = list(self.tokenizer(completion, add_special_tokens=False)["input_ids"])
        return [*ids, self.end_id]

    @property
    def end_id(self) -> int:
        """The end-of-sequence id training appends to an answer (the tokenizer's own)."""
        eos = self.tokenizer.eos_token_id
        return eos if eos is not None else min(self.eos_ids)

    def chat_text(self, messages: Sequence[Message], *, generation_prompt: bool) -> str:
        """The chat template applied to `messages`; ConfigurationError when the base has none."""
        if not self.has_chat_template:
            raise ConfigurationError(
                f"the base model {self.model_id} has no chat template, so chat messages cannot "
                "be turned into a prompt; send a plain prompt (/v1/completions, /generate), or "
                "serve a base whose tokenizer_config.json has a chat_template"
            )
        text = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=generation_prompt, tokenize=False
        )
        assert isinstance(text, str)
        return text

    def encode_chat(self, messages: Sequence[Message]) -> list[int]:
        """A chat's prompt token ids, ending where the assistant's answer starts."""
        text = self.chat_text(messages, generation_prompt=True)
        # The template writes the special tokens (BOS) itself.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        """Text of generated ids; special tokens (end-of-sequence) are left out."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def detokenizer(self) -> Detokenizer:
        return Detokenizer(self)


def _eos_ids(
    tokenizer: PreTrainedTokenizerBase, generation_config: GenerationConfig | None
) -> frozenset[int]:
    configured = generation_config.eos_token_id if generation_config is not None else None
    ids = {configured} if isinstance(configured, int) else set(configured or ())
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise ConfigurationError(
            "the base model names no end-of-sequence token (generation_config.json "
            "eos_token_id, or the tokenizer's eos_token); set one so generations can end"
        )
    return frozenset(ids)


class Detokenizer:
    """Turns a generation's tokens into text pieces as they arrive (vLLM's and TGI's method).

    Each new token is decoded together with a few tokens before it (`prefix`), because a
    tokenizer's decode of one token alone can differ from its part of the whole (leading
    spaces, byte-level BPE). Text that ends in an incomplete multi-byte character is held back
    until its last byte arrives. `finish` flushes what is left, so the pieces always add up to
    `decode` of every token.
    """

    def __init__(self, codec: TextCodec) -> None:
        self._codec = codec
        self._ids: list[int] = []
        self._prefix = 0
        """Start of the window decoded for context."""
        self._read = 0
        """Tokens before this one have been emitted as text."""
        self.text = ""
        """Every piece emitted so far."""

    def push(self, token: int) -> str:
        """The text that `token` completes; often "" while a character is incomplete."""
        self._ids.append(token)
        if token in self._codec.eos_ids:
            return ""
        before = self._codec.decode(self._ids[self._prefix : self._read])
        after = self._codec.decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith(_INCOMPLETE):
            return ""
        piece = after[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += piece
        return piece

    def finish(self) -> str:
        """What the tokens say beyond the pieces emitted so far."""
        whole = self._codec.decode(self._ids)
        rest = whole[len(self.text) :] if whole.startswith(self.text) else ""
        self.text += rest
        return rest
