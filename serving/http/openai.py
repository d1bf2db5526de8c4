"""OpenAI's routes (`serving.protocols.openai`): `/v1/completions`, `/v1/chat/completions`
(both streaming too; chat applies the base's chat template, and a base without one answers
422) and `/v1/models` (ready revisions, `parent` = the base's model id); `model` names the
revision or the base. The generation routes again under each revision's base URL
(`/adapters/{ref}`): `adapter_router`.

Responses carry `X-Mint-Request-Id` as their `id` too; more than `openai.MAX_PROMPTS` prompts
in one completion answer 422 before any prompt is tokenized."""

import time
from typing import TypeVar

from fastapi import APIRouter
from fastapi.responses import Response

from serving.engine.generation import Generating
from serving.http.common import ADAPTER_PREFIX, MintJSONResponse, adapter_of_url
from serving.http.context import CurrentCaller, route
from serving.protocols import openai

router = APIRouter()
adapter_router = APIRouter(prefix=ADAPTER_PREFIX)
_OpenAI = TypeVar("_OpenAI", bound=openai.OpenAIRequest)


@router.post("/v1/completions", response_model=None)
def completions(body: openai.CompletionRequest, caller: CurrentCaller) -> Response:
    worker = caller.worker
    params = body.sampling(worker.base.context_length)
    encoded = [worker.codec.encode(prompt) for prompt in body.prompts()]
    routed = route(caller, body.model, "cmpl", sum(map(len, encoded)))
    head = openai.Head.new(routed.request_id, routed.served)
    if body.stream:
        with routed.recorded(streaming=True):
            generating = routed.generate(encoded[0], params, streamed=True)
        events = openai.completion_stream(generating.events(), head, params.stop)
        return routed.stream(events, generating)
    # Every prompt joins the batch before any result is awaited; if one is refused or
    # fails, the others stop too: nobody is left to read them.
    started: list[Generating] = []
    with routed.recorded():
        try:
            for prompt_ids in encoded:
                started.append(routed.generate(prompt_ids, params, streamed=False))
            generations = [generating.result() for generating in started]
        finally:
            for generating in started:
                generating.cancel()
    payload = openai.completion(head, encoded, generations, params.stop, body.return_token_ids)
    return MintJSONResponse(payload, headers=routed.headers)


@router.post("/v1/chat/completions", response_model=None)
def chat_completions(body: openai.ChatRequest, caller: CurrentCaller) -> Response:
    worker = caller.worker
    params = body.sampling(worker.base.context_length)
    # ConfigurationError (422) naming the base when it has no chat template.
    prompt_ids = worker.codec.encode_chat(body.conversation())
    routed = route(caller, body.model, "chatcmpl", len(prompt_ids))
    head = openai.Head.new(routed.request_id, routed.served)
    if body.stream:
        with routed.recorded(streaming=True):
            generating = routed.generate(prompt_ids, params, streamed=True)
        events = openai.chat_stream(generating.events(), head, params.stop)
        return routed.stream(events, generating)
    with routed.recorded():
        generation = routed.generate(prompt_ids, params, streamed=False).result()
    payload = openai.chat_completion(
        head, prompt_ids, generation, params.stop, body.return_token_ids
    )
    return MintJSONResponse(payload, headers=routed.headers)


@router.get("/v1/models")
def models(caller: CurrentCaller) -> dict[str, object]:
    revisions = [str(r) for r in caller.worker.ready_revisions(caller.principal)]
    return openai.models(caller.worker.base.model_id, revisions, int(time.time()))


def _as(ref: str, body: _OpenAI) -> _OpenAI:
    """`body` as the adapter's base URL `ref` serves it (422 if it names another revision)."""
    return body.model_copy(update={"model": adapter_of_url(ref, body.model)})


@adapter_router.post("/v1/completions", response_model=None)
def adapter_completions(
    ref: str, body: openai.CompletionRequest, caller: CurrentCaller
) -> Response:
    return completions(_as(ref, body), caller)


@adapter_router.post("/v1/chat/completions", response_model=None)
def adapter_chat_completions(ref: str, body: openai.ChatRequest, caller: CurrentCaller) -> Response:
    return chat_completions(_as(ref, body), caller)
