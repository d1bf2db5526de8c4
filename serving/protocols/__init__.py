"""The wire protocols the worker speaks, one module each; `serving.http` routes requests to them.

- `tgi`: Hugging Face Text Generation Inference (`/generate`, `/generate_stream`, `/`).
- `openai`: OpenAI's completions, chat completions and models (`/v1/...`), with vLLM's
  `return_token_ids` extension.

Each module holds its protocol's request models and pure translations: from a request to the
worker's `SamplingParams`, and from what a generation yields (its `TokenEvent`s, then its
`Generation`) to the protocol's JSON bodies and server-sent events. None of them touches a
worker or an app, so each can be tested with hand-built events. Routing, keys, the readiness
gate and errors (`serving.http.errors`) are the app's.
"""

from typing import Annotated

from pydantic import BeforeValidator
from pydantic_core import PydanticCustomError

from mint_core.errors import ConfigurationError
from mint_core.model.generate import Generation
from serving.engine.generation import TokenEvent

__all__ = ["Event", "Text", "Texts", "unicode_text", "within_context"]

Event = TokenEvent | Generation
"""What a generation yields: a TokenEvent per token, then the whole Generation."""


def unicode_text(value: object) -> object:
    """`value` (a string, or a list of them) if its text is Unicode; else a validation error
    naming it. JSON can escape a lone surrogate (`"\\ud800"`), which decodes to a string no
    encoding holds: the tokenizer, the chat template and the answer's encoder all fail on it.
    Refused here, as the request is validated, for every text field of every protocol. Other
    types pass on to the field's own validation."""
    texts = value if isinstance(value, list) else [value]
    for index, text in enumerate(texts):
        if isinstance(text, str) and not text.isascii() and not _encodes(text):
            at = f" (item {index})" if isinstance(value, list) else ""
            raise PydanticCustomError(
                "unicode", f"text that is not valid Unicode (a lone surrogate){at}"
            )
    return value


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


Text = Annotated[str, BeforeValidator(unicode_text)]
"""A request's text field: a string, refused (422) when it is not Unicode (`unicode_text`)."""
Texts = Annotated[str | list[str], BeforeValidator(unicode_text)]
"""A field of one string or a list of them (a completion's `prompt`, OpenAI's `stop`)."""


def within_context(field: str, new_tokens: int, context_length: int) -> int:
    """`new_tokens`, the value of the request's `field`, if it can fit the base's context with
    a prompt of at least one token; else ConfigurationError (422) naming the limit. Refused
    before the prompt is tokenized: a request that can never fit costs nothing."""
    if new_tokens >= context_length:
        raise ConfigurationError(
            f"{field}={new_tokens} does not fit the context of this worker's base model "
            f"({context_length} tokens, the prompt's included); ask for at most "
            f"{context_length - 1}"
        )
    return new_tokens
