"""TGI's routes (`serving.protocols.tgi`): `POST /generate`, `POST /generate_stream`
(server-sent events), and `POST /` (what `huggingface_hub.InferenceClient.text_generation`
sends, streaming or not); `parameters.adapter_id` names the revision (`name@alias` or
`name:rN`; none: the base). The same under each revision's base URL (`/adapters/{ref}`, where
`POST /adapters/{ref}` is TGI's `/`): `adapter_router`."""

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from serving.http.common import ADAPTER_PREFIX, MintJSONResponse, adapter_of_url
from serving.http.context import CurrentCaller, Routed, route
from serving.protocols import tgi

router = APIRouter()
adapter_router = APIRouter(prefix=ADAPTER_PREFIX)


def special_of(request: Request) -> frozenset[int]:
    """The base's special token ids, worked out once per app (`create_app`)."""
    return request.app.state.tgi_special_ids


Special = Annotated[frozenset[int], Depends(special_of)]


def _generated(
    body: tgi.GenerateRequest, caller: CurrentCaller, special: Special
) -> tuple[dict[str, object], Routed]:
    worker = caller.worker
    params = body.parameters.sampling(worker.base.context_length)
    prompt_ids = worker.codec.encode(body.inputs)
    routed = route(caller, body.parameters.adapter_id, "gen", len(prompt_ids))
    with routed.recorded():
        generating = routed.generate(prompt_ids, params, streamed=False)
        return tgi.generated(generating.events(), body, special), routed


def _streamed(
    body: tgi.GenerateRequest, caller: CurrentCaller, special: Special
) -> StreamingResponse:
    worker = caller.worker
    params = body.parameters.sampling(worker.base.context_length)
    prompt_ids = worker.codec.encode(body.inputs)
    routed = route(caller, body.parameters.adapter_id, "gen", len(prompt_ids))
    with routed.recorded(streaming=True):
        generating = routed.generate(prompt_ids, params, streamed=True)
    events = tgi.stream(generating.events(), body, special)
    return routed.stream(events, generating)


@router.post("/generate")
def generate(
    body: tgi.GenerateRequest, caller: CurrentCaller, special: Special
) -> MintJSONResponse:
    payload, routed = _generated(body, caller, special)
    return MintJSONResponse(payload, headers=routed.headers)


@router.post("/generate_stream")
def generate_stream(
    body: tgi.GenerateRequest, caller: CurrentCaller, special: Special
) -> StreamingResponse:
    return _streamed(body, caller, special)


@router.post("/", response_model=None)
def tgi_compat(body: tgi.GenerateRequest, caller: CurrentCaller, special: Special) -> Response:
    """Where `InferenceClient(base_url=...).text_generation` posts: a list of one result,
    or the stream when `stream` is true."""
    if body.stream:
        return _streamed(body, caller, special)
    payload, routed = _generated(body, caller, special)
    return MintJSONResponse([payload], headers=routed.headers)


def _as(ref: str, body: tgi.GenerateRequest) -> tgi.GenerateRequest:
    """`body` as the adapter's base URL `ref` serves it (422 if it names another revision)."""
    adapter_id = adapter_of_url(ref, body.parameters.adapter_id)
    parameters = body.parameters.model_copy(update={"adapter_id": adapter_id})
    return body.model_copy(update={"parameters": parameters})


@adapter_router.post("", response_model=None)
@adapter_router.post("/", response_model=None)
def adapter_tgi_compat(
    ref: str, body: tgi.GenerateRequest, caller: CurrentCaller, special: Special
) -> Response:
    return tgi_compat(_as(ref, body), caller, special)


@adapter_router.post("/generate")
def adapter_generate(
    ref: str, body: tgi.GenerateRequest, caller: CurrentCaller, special: Special
) -> MintJSONResponse:
    return generate(_as(ref, body), caller, special)


@adapter_router.post("/generate_stream")
def adapter_generate_stream(
    ref: str, body: tgi.GenerateRequest, caller: CurrentCaller, special: Special
) -> StreamingResponse:
    return generate_stream(_as(ref, body), caller, special)
