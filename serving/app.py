"""The worker's HTTP API.

- TGI: `POST /generate`, `POST /generate_stream` (server-sent events), and `POST /` (what
  `huggingface_hub.InferenceClient.text_generation` sends, streaming or not);
  `parameters.adapter_id` names the revision (`name@alias` or `name:rN`; none: the base).
- OpenAI: `/v1/completions`, `/v1/chat/completions` (both streaming too; chat applies the
  base's chat template, and a base without one answers 422), `/v1/models` (ready revisions,
  `parent` = the base's model id); `model` names the revision or the base.
- MinT: `GET /v1/adapters/{name}` (readiness and residency of each revision the caller may
  use), `/health`, `/metrics` (Prometheus), and the admin endpoints under `/admin` (admit,
  sync, events), which need a key of an admin principal whenever the worker has API keys.

Errors, whatever raised them (MinT, request validation, routing, a bug), are JSON in TGI's
shape, `error` and `error_type`, plus the names that explain them: unknown key 401, not allowed
403, unknown adapter or route 404, malformed request 422, not ready 503 with Retry-After,
anything unexpected 500 (details in the log only). Inside a stream, an error is one last
event of that shape. Values echoed in messages are cut short (`shorten`), and no body or event
carries NaN or Infinity, which JSON does not have (`json_bytes`).

Prompts are the base's own tokens (its tokenizer, its chat template); a prompt that does not fit
the base's context with its `max_new_tokens` answers 422. Streamed text comes in the pieces of
an incremental detokenizer, which add up to exactly the text a non-streamed answer holds.
"""

import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Annotated, Any, Literal

import anyio
from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import to_json
from starlette.exceptions import HTTPException

from mint_core.access import ADMIN, ANONYMOUS, allows, check_access, check_admin, principal_for
from mint_core.admission import Priority
from mint_core.errors import (
    AccessDeniedError,
    AuthenticationError,
    ConfigurationError,
    MintError,
    NotFoundError,
    RegistryError,
)
from mint_core.model.generate import FinishReason, Generation
from mint_core.revisions import RevisionId, RevisionRef, check_adapter_name
from serving.sampling import SamplingParams
from serving.scheduler import Request as Generating
from serving.scheduler import TokenEvent
from serving.worker import ReadinessEntry, RevisionNotReady, Worker

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1
REVISION_HEADER = "X-Mint-Revision"
HANDLER_THREADS = 256
"""Blocking handlers (each waits on its generation) run in threads: allow many at once."""
ECHO_LIMIT = 200
"""Longest stretch of a value (adapter id, model name, field value) an error message echoes;
the rest becomes an ellipsis. A value is what the caller sent: it may be any length."""
MESSAGE_LIMIT = 4 * ECHO_LIMIT
"""Longest error message."""
LISTED_FIELDS = 5
"""Most refused fields one validation error names."""
_LONG_RUN = re.compile(rf"\S{{{ECHO_LIMIT + 1},}}")


class GenerateParameters(BaseModel):
    """TGI's generation parameters; the ones MinT does not implement (watermark, grammar,
    repetition penalties...) are accepted and ignored, as TGI clients always send them."""

    model_config = ConfigDict(extra="ignore")

    adapter_id: str | None = None
    max_new_tokens: int | None = Field(20, ge=1)
    details: bool = False
    do_sample: bool = False
    temperature: float | None = Field(None, ge=0)
    top_k: int | None = Field(None, ge=1)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0)
    stop: list[str] | None = None
    return_full_text: bool | None = False

    def sampling(self) -> SamplingParams:
        # TGI samples when asked to, or when any sampling knob moves off its neutral value.
        sample = self.do_sample or any(
            (self.temperature not in (None, 0, 1.0), self.top_k, (self.top_p or 1) < 1)
        )
        return SamplingParams(
            max_new_tokens=self.max_new_tokens or 20,
            temperature=(self.temperature or 1.0) if sample else 0.0,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            stop=tuple(self.stop or ()),
        )


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    inputs: str
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    stream: bool = False


class OpenAIRequest(BaseModel):
    """What `/v1/completions` and `/v1/chat/completions` share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    return_token_ids: bool = False
    """vLLM's extension: each choice also carries its generated `token_ids`, and the answer
    its `prompt_token_ids` (what tokenization and the chat template made of the input)."""

    def sampling(self, max_tokens: int | None) -> SamplingParams:
        if self.n != 1:
            raise ConfigurationError(f"n={self.n}: this worker returns one choice; send n=1")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return SamplingParams(
            max_new_tokens=max_tokens or self.max_tokens or 16,
            # OpenAI's default temperature is 1: requests sample unless they say otherwise.
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop=tuple(stop),
        )


class CompletionRequest(OpenAIRequest):
    prompt: str | list[str]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str


class ChatRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class AdmitRequest(BaseModel):
    adapter: str
    revision: int = Field(ge=1)
    priority: Literal["normal", "rollback"] = "normal"


def json_bytes(payload: object) -> bytes:
    """Every JSON body and stream event of the API. JSON has no NaN or Infinity: a non-finite
    float (the logprob of a damaged adapter's token) is written as null, so strict clients can
    still read the rest."""
    return to_json(payload, inf_nan_mode="null")


class JSONAnswer(JSONResponse):
    """The API's JSON responses, written by `json_bytes`. (Routes that return a dict are written
    by FastAPI through pydantic, whose rule for non-finite floats is the same: null.)"""

    def render(self, content: object) -> bytes:
        return json_bytes(content)


def clip(text: str, limit: int = ECHO_LIMIT) -> str:
    """`text`, cut to `limit` characters and an ellipsis if longer."""
    return text if len(text) <= limit else text[:limit] + "…"


def shorten(message: str) -> str:
    """`message` with each value it echoes cut short: every stretch without a space longer than
    ECHO_LIMIT (a 10,000-character adapter id), and the whole message past MESSAGE_LIMIT."""
    return clip(_LONG_RUN.sub(lambda run: clip(run[0]), message), MESSAGE_LIMIT)


@dataclass(frozen=True)
class ErrorAnswer:
    """An error as the API answers it: a status, a body in TGI's shape (`error`, `error_type`,
    plus the names that explain it) and headers. A stream sends the body as its last event."""

    status: int
    error_type: str
    message: str
    names: Mapping[str, object] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)

    @property
    def body(self) -> dict[str, object]:
        return {"error": shorten(self.message), "error_type": self.error_type, **self.names}

    def response(self) -> JSONAnswer:
        return JSONAnswer(self.body, status_code=self.status, headers=dict(self.headers))


_RETRY = {"Retry-After": str(RETRY_AFTER_S)}


def error_answer(e: Exception, request: Request | None = None) -> ErrorAnswer:
    """The one table from what went wrong to what the API answers, for every endpoint and
    stream. `request` names the route in answers about routing."""
    route = f"{request.method} {request.url.path}" if request else "this request"
    match e:
        case AuthenticationError():
            return ErrorAnswer(
                401, "unauthenticated", str(e), headers={"WWW-Authenticate": "Bearer"}
            )
        case AccessDeniedError():
            return ErrorAnswer(403, "forbidden", str(e))
        case NotFoundError():
            return ErrorAnswer(404, "not_found", str(e))
        case RevisionNotReady():
            return ErrorAnswer(503, "not_ready", str(e), entry_json(e.entry), _RETRY)
        case ConfigurationError():
            return ErrorAnswer(422, "validation", str(e))
        case RegistryError():
            return ErrorAnswer(503, "registry_unavailable", str(e), headers=_RETRY)
        case MintError():
            return ErrorAnswer(503, _error_type(e), str(e))
        case RequestValidationError():
            return ErrorAnswer(422, "validation", _refused_fields(e.errors()))
        case HTTPException(status_code=400):
            # FastAPI answers 400 to a body it cannot decode (not UTF-8), and 422 to one that
            # is not JSON; to a client both are malformed, which the API answers 422.
            return ErrorAnswer(422, "validation", f"the body is not JSON in UTF-8: {e.__cause__}")
        case HTTPException(status_code=405):
            allowed = (e.headers or {}).get("Allow", "")
            message = f"{route}: this endpoint takes {allowed}"
            return ErrorAnswer(405, "method_not_allowed", message, headers=e.headers or {})
        case HTTPException():
            status = HTTPStatus(e.status_code)
            error_type = status.phrase.lower().replace(" ", "_")
            message = f"{route}: no such endpoint" if status is HTTPStatus.NOT_FOUND else e.detail
            return ErrorAnswer(e.status_code, error_type, message, headers=e.headers or {})
        case _:
            return ErrorAnswer(500, "internal", f"{route} failed; the worker's log has the details")


def _answer_error(request: Request, e: Exception) -> Response:
    # Starlette passes an unexpected error on to the server after this answer: the server logs it.
    return error_answer(e, request).response()


def _error_type(e: MintError) -> str:
    """`ServiceError` -> `service`, for MinT errors the table does not name."""
    name = type(e).__name__.removesuffix("Error")
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _refused_fields(errors: Sequence[Any]) -> str:
    """What FastAPI refused, one clause per field: where it is, what is wrong, what was sent."""
    clauses = []
    for error in errors[:LISTED_FIELDS]:
        if error["type"] == "json_invalid":
            at = error["loc"][-1]
            clauses.append(
                f"the body is not JSON in UTF-8: {error['ctx']['error']} (character {at})"
            )
            continue
        where = ".".join(str(part) for part in error["loc"] if part != "body") or "body"
        sent = "" if error["type"] == "missing" else f", got {clip(repr(error['input']))}"
        clauses.append(f"{where}: {error['msg']}{sent}")
    if len(errors) > LISTED_FIELDS:
        clauses.append(f"and {len(errors) - LISTED_FIELDS} more")
    return "; ".join(clauses)


def entry_json(entry: ReadinessEntry) -> dict[str, object]:
    return {
        "id": str(entry.revision),
        "adapter": entry.revision.adapter,
        "revision": entry.revision.number,
        "state": entry.state.value,
        "since": entry.since,
        "reason": entry.reason,
        "queue_position": entry.queue_position,
    }


def _sse(payload: object) -> str:
    return f"data: {json_bytes(payload).decode()}\n\n"


def _openai_finish(generation: Generation) -> Literal["stop", "length"]:
    return "length" if generation.finish_reason is FinishReason.LENGTH else "stop"


def _openai_text(generation: Generation, stop: tuple[str, ...]) -> str:
    """OpenAI leaves the stop sequence out of the text (TGI keeps it)."""
    if generation.finish_reason is FinishReason.STOP_SEQUENCE:
        hit = next(s for s in stop if generation.text.endswith(s))
        return generation.text[: -len(hit)]
    return generation.text


def create_app(
    worker: Worker,
    api_keys: Mapping[str, str] | None = None,
    admin_principals: Collection[str] = (ADMIN,),
) -> FastAPI:
    """The worker's API. With `api_keys`, `Authorization: Bearer <key>` names the principal
    (no header: anonymous); without, every request is anonymous and the header is ignored.

    With keys, the admin endpoints take only principals in `admin_principals`, and
    `/v1/adapters/{name}` shows a caller the revisions its policy records let it use (admins:
    all of them, as the pipeline reads readiness with its admin key). Without keys there is no
    telling callers apart: both are open to all, as before keys existed."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        anyio.to_thread.current_default_thread_limiter().total_tokens = HANDLER_THREADS
        yield

    app = FastAPI(title="MinT serving worker", lifespan=lifespan, default_response_class=JSONAnswer)
    codec = worker.codec
    base_id = worker.base.model_id
    # What decoding leaves out of the text: the named special tokens and every added token
    # marked special (`<|im_end|>` is often neither BOS, EOS nor PAD).
    added = codec.tokenizer.added_tokens_decoder
    special_ids = frozenset(codec.tokenizer.all_special_ids) | {
        token_id for token_id, token in added.items() if token.special
    }
    keys = dict(api_keys or {})
    admins = frozenset(admin_principals)

    def principal(authorization: Annotated[str | None, Header()] = None) -> str:
        if not keys or authorization is None:
            return ANONYMOUS
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthenticationError("send the API key as 'Authorization: Bearer <key>'")
        return principal_for(keys, key.strip())

    Principal = Annotated[str, Depends(principal)]

    def admin(request: Request, who: Principal) -> None:
        """Every route under /admin depends on this: with API keys, only admin principals."""
        if not keys:
            return
        if who == ANONYMOUS:
            raise AuthenticationError(
                f"{request.method} {request.url.path} needs an admin key of this worker; send "
                "'Authorization: Bearer <key>' with a key whose principal is in "
                "MINT_ADMIN_PRINCIPALS"
            )
        check_admin(who, admins)

    for raised in (MintError, RequestValidationError, HTTPException, Exception):
        app.add_exception_handler(raised, _answer_error)

    def start(
        prompt_ids: list[int], model: str | None, params: SamplingParams, who: str
    ) -> tuple[str, Generating]:
        """Route `model` (a revision reference, or none/the base id for the base) through the
        readiness gate and queue the generation of `prompt_ids`; the name of what serves it,
        and the request."""
        ref = None if model in (None, "", base_id, "base") else RevisionRef.parse(model)
        revision, key = worker.route(ref, who)
        return (str(revision) if revision else base_id), worker.generate(prompt_ids, key, params)

    def streamed(
        generating: Generating, served: str, events: Callable[[TokenEvent | Generation], str]
    ) -> StreamingResponse:
        def body() -> Iterator[str]:
            try:
                for event in generating.events():
                    if text := events(event):
                        yield text
            except Exception as e:  # the answer has started: the error is its last event
                if not isinstance(e, MintError):
                    log.exception("stream from %s failed", served)  # the server never sees it
                yield _sse(error_answer(e).body)
            finally:
                generating.cancel()  # a no-op once finished; frees the row if the client left

        return StreamingResponse(
            body(), media_type="text/event-stream", headers={REVISION_HEADER: served}
        )

    # TGI.

    def tgi_token(event: TokenEvent) -> dict[str, object]:
        return {
            "id": event.token_id,
            "text": event.text,
            "logprob": event.logprob,
            "special": event.token_id in special_ids,
        }

    def tgi_details(generation: Generation) -> dict[str, object]:
        return {
            "finish_reason": generation.finish_reason.value,
            "generated_tokens": len(generation.token_ids),
            "seed": generation.seed,
        }

    def tgi_generate(body: GenerateRequest, who: str) -> tuple[dict[str, object], str]:
        params = body.parameters
        prompt_ids = codec.encode(body.inputs)
        served, generating = start(prompt_ids, params.adapter_id, params.sampling(), who)
        # The token events carry the detokenizer's pieces: each token's text in `details`.
        *tokens, generation = generating.events()
        assert isinstance(generation, Generation)
        prefix = body.inputs if params.return_full_text else ""
        payload: dict[str, object] = {"generated_text": prefix + generation.text}
        if params.details:
            sent = [tgi_token(token) for token in tokens if isinstance(token, TokenEvent)]
            payload["details"] = tgi_details(generation) | {"prefill": [], "tokens": sent}
        return payload, served

    def tgi_stream(body: GenerateRequest, who: str) -> StreamingResponse:
        params = body.parameters
        prompt_ids = codec.encode(body.inputs)
        served, generating = start(prompt_ids, params.adapter_id, params.sampling(), who)
        prefix = body.inputs if params.return_full_text else ""
        # Each token is sent when the next event comes: the last one carries the totals.
        pending: list[TokenEvent] = []
        sent = 0

        def event(e: TokenEvent | Generation) -> str:
            nonlocal sent
            out = ""
            if pending:
                final = e if isinstance(e, Generation) else None
                out = _sse(
                    {
                        "index": sent,
                        "token": tgi_token(pending.pop()),
                        "generated_text": prefix + final.text if final else None,
                        "details": tgi_details(final) if final else None,
                    }
                )
                sent += 1
            if isinstance(e, TokenEvent):
                pending.append(e)
            return out

        return streamed(generating, served, event)

    @app.post("/generate")
    def generate(body: GenerateRequest, who: Principal) -> JSONResponse:
        payload, served = tgi_generate(body, who)
        return JSONAnswer(payload, headers={REVISION_HEADER: served})

    @app.post("/generate_stream")
    def generate_stream(body: GenerateRequest, who: Principal) -> StreamingResponse:
        return tgi_stream(body, who)

    @app.post("/", response_model=None)
    def tgi_compat(body: GenerateRequest, who: Principal) -> Response:
        """Where `InferenceClient(base_url=...).text_generation` posts: a list of one result,
        or the stream when `stream` is true."""
        if body.stream:
            return tgi_stream(body, who)
        payload, served = tgi_generate(body, who)
        return JSONAnswer([payload], headers={REVISION_HEADER: served})

    # OpenAI.

    def openai_stream(
        generating: Generating,
        served: str,
        params: SamplingParams,
        chunk: Callable[[str, str | None], dict[str, object]],
    ) -> StreamingResponse:
        # Hold back as much text as the longest stop sequence: a token event comes before the
        # news that it completed one, and OpenAI leaves stop sequences out.
        hold = max((len(s) for s in params.stop), default=0)
        sent = 0
        text = ""

        def event(e: TokenEvent | Generation) -> str:
            nonlocal sent, text
            if isinstance(e, TokenEvent):
                text += e.text
                if len(text) - hold <= sent:
                    return ""
                piece, sent = text[sent : len(text) - hold], len(text) - hold
                return _sse(chunk(piece, None))
            final = _openai_text(e, params.stop)
            tail = final[sent:] if len(final) > sent else ""
            return _sse(chunk(tail, _openai_finish(e))) + "data: [DONE]\n\n"

        return streamed(generating, served, event)

    @app.post("/v1/completions", response_model=None)
    def completions(body: CompletionRequest, who: Principal) -> Response:
        params = body.sampling(None)
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if not prompts:
            raise ConfigurationError("prompt is an empty list; send at least one prompt")
        encoded = [codec.encode(prompt) for prompt in prompts]
        common = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
        }
        if body.stream:
            if len(prompts) != 1:
                raise ConfigurationError("streaming takes one prompt; send a string")
            served, generating = start(encoded[0], body.model, params, who)

            def chunk(text: str, finish: str | None) -> dict[str, object]:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
                return common | {"model": served, "choices": [choice]}

            return openai_stream(generating, served, params, chunk)
        started = [start(prompt_ids, body.model, params, who) for prompt_ids in encoded]
        choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0}
        for index, (prompt_ids, (_, generating)) in enumerate(zip(encoded, started, strict=True)):
            generation = generating.result()
            choice = {
                "index": index,
                "text": _openai_text(generation, params.stop),
                "logprobs": None,
                "finish_reason": _openai_finish(generation),
            }
            if body.return_token_ids:
                choice |= {"prompt_token_ids": prompt_ids, "token_ids": generation.token_ids}
            choices.append(choice)
            usage["prompt_tokens"] += len(prompt_ids)
            usage["completion_tokens"] += len(generation.token_ids)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        served = started[0][0]
        payload = common | {"model": served, "choices": choices, "usage": usage}
        return JSONAnswer(payload, headers={REVISION_HEADER: served})

    @app.post("/v1/chat/completions", response_model=None)
    def chat_completions(body: ChatRequest, who: Principal) -> Response:
        params = body.sampling(body.max_completion_tokens)
        # ConfigurationError (422) naming the base when it has no chat template.
        prompt_ids = codec.encode_chat([message.model_dump() for message in body.messages])
        served, generating = start(prompt_ids, body.model, params, who)
        common = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": served,
        }
        if body.stream:
            first = [True]

            def chunk(text: str, finish: str | None) -> dict[str, object]:
                delta: dict[str, str] = {"content": text}
                if first[0]:
                    delta["role"] = "assistant"
                    first[0] = False
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
                return common | {"object": "chat.completion.chunk", "choices": [choice]}

            return openai_stream(generating, served, params, chunk)
        generation = generating.result()
        message = {"role": "assistant", "content": _openai_text(generation, params.stop)}
        prompt_tokens = len(prompt_ids)
        choice = {"index": 0, "message": message, "finish_reason": _openai_finish(generation)}
        if body.return_token_ids:
            choice["token_ids"] = generation.token_ids
            common["prompt_token_ids"] = prompt_ids
        payload = common | {
            "object": "chat.completion",
            "choices": [choice],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": len(generation.token_ids),
                "total_tokens": prompt_tokens + len(generation.token_ids),
            },
        }
        return JSONAnswer(payload, headers={REVISION_HEADER: served})

    @app.get("/v1/models")
    def models(who: Principal) -> dict[str, object]:
        now = int(time.time())
        data = [{"id": base_id, "object": "model", "created": now, "owned_by": "mint"}]
        data += [
            {"id": str(r), "object": "model", "created": now, "owned_by": "mint", "parent": base_id}
            for r in worker.ready_revisions(who)
        ]
        return {"object": "list", "data": data}

    # MinT.

    @app.get("/health")
    def health() -> dict[str, object]:
        """`ok`, or `degraded` while the registry cannot be reached (serving goes on); and the
        base it serves: model id, weights digest, family and context length."""
        return {
            "status": "degraded" if worker.degraded else "ok",
            "degraded_reason": worker.degraded,
            "last_sync": worker.catalog.last_sync,
            "base_model": base_id,
            "base_digest": worker.base.digest,
            "base_family": worker.base.family,
            "context_length": worker.base.context_length,
            "queue_depth": worker.queue_depth,
            "batch_size": worker.batch_size,
            "request_path_loads": worker.request_path_loads,
        }

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(worker.metrics.exposition(), media_type="text/plain; version=0.0.4")

    def usable(entries: list[ReadinessEntry], who: str) -> list[ReadinessEntry]:
        """The entries of revisions `who` may use. None of them at all is refused as
        generation refuses it (403 naming the adapter): the adapter's existence is no secret
        from a caller generation already tells, and 404 would send it looking for a typo."""
        policies = {e.revision: worker.catalog.record(e.revision).policy for e in entries}
        allowed = [e for e in entries if allows(policies[e.revision], who)]
        if entries and not allowed:
            newest = entries[-1].revision
            check_access(policies[newest], who, newest)
        return allowed

    @app.get("/v1/adapters/{name}")
    def adapter_status(name: str, who: Principal) -> dict[str, object]:
        check_adapter_name(name)
        entries = worker.entries(name)
        if not entries and not worker.catalog.knows(name):
            raise NotFoundError(f"adapter {name!r} is not registered")
        if keys and who not in admins:
            entries = usable(entries, who)
        residency = worker.residency
        pins = {entry.key: entry.pins for entry in residency.slot_table()}
        revisions = []
        for entry in entries:
            key = str(entry.revision)
            tiers = {
                "host": residency.in_host(key),
                "device_slot": residency.slot_of(key),
                "pins": pins.get(key, 0),
            }
            revisions.append(entry_json(entry) | {"residency": tiers})
        return {"adapter": name, "revisions": revisions}

    # Admin: a route added to this router is guarded like the others.
    admin_api = APIRouter(prefix="/admin", dependencies=[Depends(admin)])

    @admin_api.post("/admit", status_code=202)
    def admit(body: AdmitRequest) -> dict[str, object]:
        revision = worker.catalog.record(
            RevisionId(check_adapter_name(body.adapter), body.revision)
        ).id
        return entry_json(worker.admit(revision, Priority[body.priority.upper()]))

    @admin_api.post("/sync", status_code=202)
    def sync() -> dict[str, object]:
        """Catch up with the registry now (activation calls it after moving an alias)."""
        return {"admitted": [str(r) for r in worker.sync()]}

    @admin_api.get("/events")
    def events() -> dict[str, object]:
        """Every readiness change on this worker since it started, oldest first."""
        return {
            "events": [
                {"at": e.since, "id": str(e.revision), "state": e.state.value, "reason": e.reason}
                for e in worker.events()
            ]
        }

    app.include_router(admin_api)
    return app
