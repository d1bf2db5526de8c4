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

from mint_core.errors import ConfigurationError
from mint_core.model.generate import Generation
from serving.engine.generation import TokenEvent

__all__ = ["Event", "within_context"]

Event = TokenEvent | Generation
"""What a generation yields: a TokenEvent per token, then the whole Generation."""


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
