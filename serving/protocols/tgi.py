"""Text Generation Inference (TGI), Hugging Face's protocol: `POST /generate`, `POST
/generate_stream` (server-sent events), and `POST /` (what `huggingface_hub.InferenceClient`
`.text_generation` sends, streaming or not).

Quirks kept, as TGI clients expect them:

- `parameters.adapter_id` names the revision (`name@alias` or `name:rN`); none: the base.
- Sampling parameters TGI has and MinT does not implement (watermark, grammar, repetition
  penalties...) are accepted and ignored: clients always send them. A request samples when
  `do_sample` says so, or when any sampling knob moves off its neutral value.
- The generated text keeps the stop sequence that ended it (OpenAI's leaves it out), and
  `return_full_text` puts the prompt in front of it.
- `parameters.return_routes` (a MinT extension, for R3 routing replay in RL) adds to `details`
  `routed_experts`, per generated token the experts each MoE layer routed it to (`[tokens,
  layers, top_k]`, vLLM's name), and `prompt_routed_experts`, the same for the prompt's
  positions but the last (whose route is the first token's).
- A stream sends each token when the next event comes, so that the last token's event can
  carry `generated_text` and `details`; the events before it carry null for both.
"""

from collections.abc import Iterable, Iterator

from pydantic import BaseModel, ConfigDict, Field

from mint_core.model.generate import Generation
from mint_core.model.text import TextCodec
from serving.engine.generation import TokenEvent
from serving.engine.sampling import SamplingParams
from serving.http.common import sse
from serving.protocols import Event, Text, within_context

MAX_SEED = 2**64 - 1
"""TGI's seed is an unsigned 64-bit integer; so is the generator's."""


class GenerateParameters(BaseModel):
    """TGI's generation parameters."""

    model_config = ConfigDict(extra="ignore")

    adapter_id: Text | None = None
    max_new_tokens: int | None = Field(20, ge=1)
    details: bool = False
    do_sample: bool = False
    temperature: float | None = Field(None, ge=0)
    top_k: int | None = Field(None, ge=1)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: list[Text] | None = None
    return_full_text: bool | None = False
    return_routes: bool = False

    def sampling(self, context_length: int) -> SamplingParams:
        """The worker's parameters; 422 when `max_new_tokens` cannot fit `context_length`."""
        sample = self.do_sample or any(
            (self.temperature not in (None, 0, 1.0), self.top_k, (self.top_p or 1) < 1)
        )
        new_tokens = self.max_new_tokens or 20
        return SamplingParams(
            max_new_tokens=within_context("max_new_tokens", new_tokens, context_length),
            temperature=(self.temperature or 1.0) if sample else 0.0,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            stop=tuple(self.stop or ()),
            return_routes=self.return_routes,
        )


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    inputs: Text
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    stream: bool = False

    @property
    def prefix(self) -> str:
        """What goes in front of the generated text: the prompt with `return_full_text`."""
        return self.inputs if self.parameters.return_full_text else ""


def special_ids(codec: TextCodec) -> frozenset[int]:
    """The ids a token event marks `special`: what decoding leaves out of the text, the named
    special tokens and every added token marked special (`<|im_end|>` is often neither BOS, EOS
    nor PAD)."""
    added = codec.tokenizer.added_tokens_decoder
    return frozenset(codec.tokenizer.all_special_ids) | {
        token_id for token_id, token in added.items() if token.special
    }


def token(event: TokenEvent, special: frozenset[int]) -> dict[str, object]:
    """One token as `details.tokens` and stream events show it; its text is the detokenizer's
    piece (what this token adds to the text)."""
    return {
        "id": event.token_id,
        "text": event.text,
        "logprob": event.logprob,
        "special": event.token_id in special,
    }


def details(generation: Generation) -> dict[str, object]:
    body: dict[str, object] = {
        "finish_reason": generation.finish_reason.value,
        "generated_tokens": len(generation.token_ids),
        "seed": generation.seed,
    }
    if generation.routes is not None:
        body["routed_experts"] = generation.routes
        body["prompt_routed_experts"] = generation.prompt_routes
    return body


def generated(
    events: Iterable[Event], request: GenerateRequest, special: frozenset[int]
) -> dict[str, object]:
    """The body of a non-streamed answer (`/` sends it in a list of one)."""
    *tokens, generation = events
    assert isinstance(generation, Generation), "a generation's last event is its Generation"
    body: dict[str, object] = {"generated_text": request.prefix + generation.text}
    if request.parameters.details:
        sent = [token(event, special) for event in tokens if isinstance(event, TokenEvent)]
        body["details"] = details(generation) | {"prefill": [], "tokens": sent}
    return body


def stream(
    events: Iterable[Event], request: GenerateRequest, special: frozenset[int]
) -> Iterator[str]:
    """The server-sent events of a streamed answer, one per token."""
    pending: TokenEvent | None = None
    for index, event in enumerate(events):
        if pending is not None:
            final = event if isinstance(event, Generation) else None
            yield sse(
                {
                    "index": index - 1,
                    "token": token(pending, special),
                    "generated_text": request.prefix + final.text if final else None,
                    "details": details(final) if final else None,
                }
            )
        pending = event if isinstance(event, TokenEvent) else None
