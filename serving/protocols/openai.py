"""OpenAI's protocol: `POST /v1/completions`, `POST /v1/chat/completions` (both streaming too),
`GET /v1/models`.

Quirks kept, as OpenAI clients expect them:

- `model` names the revision (`name@alias` or `name:rN`), or the base by its model id (or
  `base`); `/v1/models` lists the base and the revisions ready for the caller, each with
  `parent` = the base's model id.
- Requests sample unless they say otherwise: OpenAI's default temperature is 1. One choice per
  prompt (`n` must be 1); a completion may send several prompts, answered in one body (not
  when streaming).
- The text leaves out the stop sequence that ended it (TGI's keeps it). A stream holds back as
  much text as the longest stop sequence, since a token's event comes before the news that it
  completed one; the last chunk carries the rest and the finish reason, then `data: [DONE]`.
- Finish reasons are OpenAI's two: `length`, or `stop` for an end-of-sequence token and a stop
  sequence alike.
- Chat applies the base's chat template; a streamed chat's first delta names the role. A chat
  answer carries `system_fingerprint` (the revision that answered: what the answer depends on)
  and its choice `logprobs` (null): TGI's `text-generation` client requires both.
- `return_token_ids` (vLLM's extension): each choice also carries its generated `token_ids`,
  and the answer its `prompt_token_ids` (what tokenization and the chat template made of the
  input); streams ignore it.
"""

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from mint_core.config import MAX_PROMPTS
from mint_core.errors import ConfigurationError
from mint_core.model.generate import FinishReason, Generation
from mint_core.model.text import Message
from serving.engine.generation import TokenEvent
from serving.engine.sampling import SamplingParams, stop_hit
from serving.http.common import sse
from serving.protocols import Event, Text, Texts, within_context

DONE = "data: [DONE]\n\n"
"""The event that ends a stream (not JSON)."""

Finish = Literal["stop", "length"]


class OpenAIRequest(BaseModel):
    """What `/v1/completions` and `/v1/chat/completions` share."""

    model_config = ConfigDict(extra="ignore")

    model: Text
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: Texts | None = None
    n: int | None = 1
    """Choices per prompt; only 1 (null too: TGI's `text-generation` client sends it)."""
    stream: bool = False
    return_token_ids: bool = False

    def new_tokens(self) -> tuple[str, int]:
        """The field that asks for new tokens, and how many (OpenAI's default: 16)."""
        return "max_tokens", self.max_tokens or 16

    def sampling(self, context_length: int) -> SamplingParams:
        """The worker's parameters; 422 when the new tokens cannot fit `context_length`."""
        if self.n not in (None, 1):
            raise ConfigurationError(f"n={self.n}: this worker returns one choice; send n=1")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return SamplingParams(
            max_new_tokens=within_context(*self.new_tokens(), context_length),
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop=tuple(stop),
        )


class CompletionRequest(OpenAIRequest):
    prompt: Texts

    def prompts(self) -> list[str]:
        prompts = [self.prompt] if isinstance(self.prompt, str) else self.prompt
        if not prompts:
            raise ConfigurationError("prompt is an empty list; send at least one prompt")
        if len(prompts) > MAX_PROMPTS:
            raise ConfigurationError(
                f"prompt is a list of {len(prompts)} prompts; send at most {MAX_PROMPTS} "
                "(MAX_PROMPTS) in one request"
            )
        if self.stream and len(prompts) != 1:
            raise ConfigurationError("streaming takes one prompt; send a string")
        return prompts


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Text
    content: Text


class ChatRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    """OpenAI's newer name for `max_tokens`; it wins when both are sent."""

    def new_tokens(self) -> tuple[str, int]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return super().new_tokens()

    def conversation(self) -> list[Message]:
        return [message.model_dump() for message in self.messages]


@dataclass(frozen=True)
class Head:
    """What every body and chunk of one answer starts with."""

    id: str
    created: int
    """Unix time."""
    model: str
    """What serves it: the exact revision (`name:rN`) or the base's model id."""

    @classmethod
    def new(cls, request_id: str, model: str) -> "Head":
        """The head of an answer to the request `request_id` (its `X-Mint-Request-Id`)."""
        return cls(request_id, int(time.time()), model)

    def json(self, kind: str) -> dict[str, object]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def finish_reason(generation: Generation) -> Finish:
    return "length" if generation.finish_reason is FinishReason.LENGTH else "stop"


def visible_text(generation: Generation, stop: Sequence[str]) -> str:
    """The generation's text less the stop sequence that ended it."""
    hit = stop_hit(generation.text, tuple(stop))
    if generation.finish_reason is FinishReason.STOP_SEQUENCE and hit:
        return generation.text[: -len(hit)]
    return generation.text


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion(
    head: Head,
    prompts: Sequence[Sequence[int]],
    generations: Sequence[Generation],
    stop: Sequence[str],
    token_ids: bool,
) -> dict[str, object]:
    """The body of `/v1/completions`: one choice per prompt (token ids), in order."""
    choices = []
    for index, (prompt_ids, generation) in enumerate(zip(prompts, generations, strict=True)):
        choice = {
            "index": index,
            "text": visible_text(generation, stop),
            "logprobs": None,
            "finish_reason": finish_reason(generation),
        }
        if token_ids:
            choice |= {"prompt_token_ids": list(prompt_ids), "token_ids": generation.token_ids}
        choices.append(choice)
    counts = usage(
        sum(len(prompt_ids) for prompt_ids in prompts),
        sum(len(generation.token_ids) for generation in generations),
    )
    return head.json("text_completion") | {"choices": choices, "usage": counts}


def chat_completion(
    head: Head,
    prompt_ids: Sequence[int],
    generation: Generation,
    stop: Sequence[str],
    token_ids: bool,
) -> dict[str, object]:
    """The body of `/v1/chat/completions`."""
    message = {"role": "assistant", "content": visible_text(generation, stop)}
    choice: dict[str, object] = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": finish_reason(generation),
    }
    body = head.json("chat.completion") | {"system_fingerprint": head.model}
    if token_ids:
        choice["token_ids"] = generation.token_ids
        body["prompt_token_ids"] = list(prompt_ids)
    return body | {
        "choices": [choice],
        "usage": usage(len(prompt_ids), len(generation.token_ids)),
    }


def pieces(events: Iterable[Event], stop: Sequence[str]) -> Iterator[tuple[str, Finish | None]]:
    """The text of a stream, piece by piece, each with its finish reason (the last one's
    only): what a non-streamed answer's text holds, with the stop sequence left out."""
    hold = max((len(s) for s in stop), default=0)
    text, sent = "", 0
    for event in events:
        if isinstance(event, TokenEvent):
            text += event.text
            if len(text) - hold > sent:
                yield text[sent : len(text) - hold], None
                sent = len(text) - hold
        else:
            yield visible_text(event, stop)[sent:], finish_reason(event)


def completion_stream(events: Iterable[Event], head: Head, stop: Sequence[str]) -> Iterator[str]:
    """The server-sent events of a streamed completion."""

    def chunk(index: int, text: str, finish: Finish | None) -> dict[str, object]:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return head.json("text_completion") | {"choices": [choice]}

    return _stream(events, stop, chunk)


def chat_stream(events: Iterable[Event], head: Head, stop: Sequence[str]) -> Iterator[str]:
    """The server-sent events of a streamed chat completion; the first delta names the role."""

    def chunk(index: int, text: str, finish: Finish | None) -> dict[str, object]:
        delta = {"content": text} | ({"role": "assistant"} if index == 0 else {})
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return head.json("chat.completion.chunk") | {"choices": [choice]}

    return _stream(events, stop, chunk)


def _stream(
    events: Iterable[Event],
    stop: Sequence[str],
    chunk: Callable[[int, str, Finish | None], dict[str, object]],
) -> Iterator[str]:
    for index, (text, finish) in enumerate(pieces(events, stop)):
        yield sse(chunk(index, text, finish))
    yield DONE


def models(base_id: str, revisions: Iterable[str], created: int) -> dict[str, object]:
    """The body of `/v1/models`: the base, then each revision (`parent` = the base)."""
    data = [{"id": base_id, "object": "model", "created": created, "owned_by": "mint"}]
    data += [
        {"id": r, "object": "model", "created": created, "owned_by": "mint", "parent": base_id}
        for r in revisions
    ]
    return {"object": "list", "data": data}
