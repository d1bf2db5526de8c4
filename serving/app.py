"""The worker's HTTP API: routing, API keys, the readiness gate, limits on what a request may
ask, and the wiring from each protocol's requests to the worker and back.

- TGI (`serving.protocols.tgi`): `POST /generate`, `POST /generate_stream` (server-sent events),
  and `POST /` (what `huggingface_hub.InferenceClient.text_generation` sends, streaming or not);
  `parameters.adapter_id` names the revision (`name@alias` or `name:rN`; none: the base).
- OpenAI (`serving.protocols.openai`): `/v1/completions`, `/v1/chat/completions` (both
  streaming too; chat applies the base's chat template, and a base without one answers 422),
  `/v1/models` (ready revisions, `parent` = the base's model id); `model` names the revision or
  the base.
- Per revision reference, a base URL of its own, `/adapters/{ref}` (`ref`: `name@alias` or
  `name:rN`): every generation route above under it (`POST /adapters/{ref}` is TGI's `/`)
  answers as that revision, for clients that cannot name one, such as TGI's own `text-generation`
  client (it posts to its base URL and sends every chat with `model` "tgi"). A body that names
  another revision is refused (422) rather than either being chosen silently.
- MinT: `GET /v1/adapters/{name}` (readiness and residency of each revision the caller may
  use), `POST /v1/feedback` (a score in [0, 1] for an answer, by its request id), `/health`,
  `/metrics` (Prometheus), and the admin endpoints under `/admin` (admit, sync, routing, events,
  outcomes), which need a key of an admin principal whenever the worker has API keys.

Generation answers carry `X-Mint-Revision`: what served them, the exact revision or the base's
model id, chosen once per request (a canary's share included), streams and multi-prompt
completions too; and `X-Mint-Request-Id`, which OpenAI answers also carry as their `id`: what
feedback names. Each answer's outcome is kept per revision (`serving.outcomes`).

Errors, inside streams too, are JSON in TGI's shape, `error` and `error_type`, with the status
codes of `serving.http.errors`.

Hostile input is refused early, each time naming the limit: a body over `max_request_bytes`
answers 413 (declared or not: a chunked body is counted as it arrives), so no prompt costs an
unbounded tokenization; new tokens the base's context cannot hold, and more than
`openai.MAX_PROMPTS` prompts in one completion, answer 422 before any prompt is tokenized; a
prompt that does not fit the context with its new tokens answers 422 with both numbers.

Prompts are the base's own tokens (its tokenizer, its chat template). Streamed text comes in
the pieces of an incremental detokenizer, which add up to exactly the text a non-streamed
answer holds.
"""

import logging
import time
from collections.abc import AsyncIterator, Collection, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Annotated, Literal, TypeVar

import anyio
from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException

from mint_core.access import ADMIN, ANONYMOUS, allows, check_access, check_admin, principal_for
from mint_core.admission import Priority
from mint_core.errors import AuthenticationError, MintError, NotFoundError
from mint_core.revisions import RevisionId, RevisionRef, check_adapter_name
from serving.generation import Request as Generating
from serving.http.common import (
    ADAPTER_PREFIX,
    REQUEST_ID_HEADER,
    REVISION_HEADER,
    MintJSONResponse,
    adapter_of_url,
    entry_json,
    sse,
)
from serving.http.errors import ECHO_LIMIT, error_response
from serving.http.limits import MAX_REQUEST_BYTES, BodyLimit
from serving.protocols import openai, tgi
from serving.worker import ReadinessEntry, Worker

__all__ = ["ADAPTER_PREFIX", "ECHO_LIMIT", "MAX_REQUEST_BYTES", "adapter_of_url", "create_app"]

log = logging.getLogger(__name__)

HANDLER_THREADS = 256
"""Blocking handlers (each waits on its generation) run in threads: allow many at once."""
_OpenAI = TypeVar("_OpenAI", bound=openai.OpenAIRequest)


class AdmitRequest(BaseModel):
    adapter: str
    revision: int = Field(ge=1)
    priority: Literal["normal", "rollback"] = "normal"


class FeedbackRequest(BaseModel):
    request_id: str = Field(min_length=1, max_length=200)
    """An answer's `X-Mint-Request-Id`."""
    score: float = Field(ge=0, le=1, allow_inf_nan=False)
    """How good the answer was, from 0 (wrong) to 1 (right)."""


@dataclass(frozen=True)
class Routed:
    """A generation request once routed: what serves it, for its whole life."""

    served: str
    """The exact revision, or the base's model id."""
    key: str
    """Its engine key."""
    request_id: str
    at: float
    """perf_counter() when it was routed: its latency counts from here."""

    @property
    def headers(self) -> dict[str, str]:
        return {REVISION_HEADER: self.served, REQUEST_ID_HEADER: self.request_id}


def _answer_error(request: Request, e: Exception) -> Response:
    # Starlette passes an unexpected error on to the server after this answer: the server logs it.
    return error_response(e, request).to_response()


def create_app(
    worker: Worker,
    api_keys: Mapping[str, str] | None = None,
    admin_principals: Collection[str] = (ADMIN,),
    max_request_bytes: int = MAX_REQUEST_BYTES,
) -> FastAPI:
    """The worker's API. With `api_keys`, `Authorization: Bearer <key>` names the principal
    (no header: anonymous); without, every request is anonymous and the header is ignored.

    With keys, the admin endpoints take only principals in `admin_principals`, and
    `/v1/adapters/{name}` shows a caller the revisions its policy records let it use (admins:
    all of them, as the pipeline reads readiness with its admin key); admins may also generate
    with every revision (the evaluation gate scores each team's). Without keys there is no
    telling callers apart: both are open to all, as before keys existed."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        anyio.to_thread.current_default_thread_limiter().total_tokens = HANDLER_THREADS
        yield

    app = FastAPI(
        title="MinT serving worker", lifespan=lifespan, default_response_class=MintJSONResponse
    )
    app.add_middleware(BodyLimit, limit=max_request_bytes)
    codec = worker.codec
    base_id = worker.base.model_id
    context_length = worker.base.context_length
    special = tgi.special_ids(codec)
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

    def route(model: str | None, who: str, kind: str) -> Routed:
        """Route `model` (a revision reference, or none/the base id for the base) through the
        readiness gate, once for the whole request, and give the answer its request id
        (`<kind>-<hex>`)."""
        ref = None if model in (None, "", base_id, "base") else RevisionRef.parse(model)
        revision, key = worker.route(ref, who, admin=bool(keys) and who in admins)
        served = str(revision) if revision else base_id
        return Routed(served, key, worker.outcomes.started(served, who, kind), time.perf_counter())

    def finished(routed: Routed, error: Exception | None) -> None:
        """Record the answer's outcome: its latency, and whether it failed on the worker's
        side (a refusal of the request itself, 4xx, is the caller's)."""
        failed = error is not None and error_response(error).status >= 500
        worker.outcomes.finished(routed.served, time.perf_counter() - routed.at, failed)

    @contextmanager
    def answering(routed: Routed, streaming: bool = False) -> Iterator[None]:
        """Around the work of an answer: records its outcome if it fails here, or when it ends
        here (a stream that starts records its own end)."""
        try:
            yield
        except Exception as e:
            finished(routed, e)
            raise
        if not streaming:
            finished(routed, None)

    def streamed(
        events: Iterator[str], generating: Generating, routed: Routed
    ) -> StreamingResponse:
        """A protocol's events of `generating` as they come; an error after the answer has
        started is its last event."""

        def body() -> Iterator[str]:
            error = None
            try:
                yield from events
            except Exception as e:
                if not isinstance(e, MintError):
                    # The server never sees it: log it here.
                    log.exception("stream from %s failed", routed.served)
                error = e
                yield sse(error_response(e).body)
            finally:
                generating.cancel()  # a no-op once finished; frees the row if the client left
                finished(routed, error)

        return StreamingResponse(body(), media_type="text/event-stream", headers=routed.headers)

    # TGI.

    def tgi_answer(body: tgi.GenerateRequest, who: str) -> tuple[dict[str, object], Routed]:
        params = body.parameters.sampling(context_length)
        prompt_ids = codec.encode(body.inputs)
        routed = route(body.parameters.adapter_id, who, "gen")
        with answering(routed):
            generating = worker.generate(prompt_ids, routed.key, params, streamed=False)
            return tgi.generated(generating.events(), body, special), routed

    def tgi_stream(body: tgi.GenerateRequest, who: str) -> StreamingResponse:
        params = body.parameters.sampling(context_length)
        prompt_ids = codec.encode(body.inputs)
        routed = route(body.parameters.adapter_id, who, "gen")
        with answering(routed, streaming=True):
            generating = worker.generate(prompt_ids, routed.key, params, streamed=True)
        return streamed(tgi.stream(generating.events(), body, special), generating, routed)

    @app.post("/generate")
    def generate(body: tgi.GenerateRequest, who: Principal) -> MintJSONResponse:
        payload, routed = tgi_answer(body, who)
        return MintJSONResponse(payload, headers=routed.headers)

    @app.post("/generate_stream")
    def generate_stream(body: tgi.GenerateRequest, who: Principal) -> StreamingResponse:
        return tgi_stream(body, who)

    @app.post("/", response_model=None)
    def tgi_compat(body: tgi.GenerateRequest, who: Principal) -> Response:
        """Where `InferenceClient(base_url=...).text_generation` posts: a list of one result,
        or the stream when `stream` is true."""
        if body.stream:
            return tgi_stream(body, who)
        payload, routed = tgi_answer(body, who)
        return MintJSONResponse([payload], headers=routed.headers)

    # OpenAI.

    @app.post("/v1/completions", response_model=None)
    def completions(body: openai.CompletionRequest, who: Principal) -> Response:
        params = body.sampling(context_length)
        encoded = [codec.encode(prompt) for prompt in body.prompts()]
        routed = route(body.model, who, "cmpl")
        head = openai.Head.new(routed.request_id, routed.served)
        if body.stream:
            with answering(routed, streaming=True):
                generating = worker.generate(encoded[0], routed.key, params, streamed=True)
            events = openai.completion_stream(generating.events(), head, params.stop)
            return streamed(events, generating, routed)
        # Every prompt joins the batch before any answer is awaited; if one is refused or
        # fails, the others stop too: nobody is left to read them.
        started: list[Generating] = []
        with answering(routed):
            try:
                for prompt_ids in encoded:
                    started.append(worker.generate(prompt_ids, routed.key, params, streamed=False))
                generations = [generating.result() for generating in started]
            finally:
                for generating in started:
                    generating.cancel()
        payload = openai.completion(head, encoded, generations, params.stop, body.return_token_ids)
        return MintJSONResponse(payload, headers=routed.headers)

    @app.post("/v1/chat/completions", response_model=None)
    def chat_completions(body: openai.ChatRequest, who: Principal) -> Response:
        params = body.sampling(context_length)
        # ConfigurationError (422) naming the base when it has no chat template.
        prompt_ids = codec.encode_chat(body.conversation())
        routed = route(body.model, who, "chatcmpl")
        head = openai.Head.new(routed.request_id, routed.served)
        if body.stream:
            with answering(routed, streaming=True):
                generating = worker.generate(prompt_ids, routed.key, params, streamed=True)
            events = openai.chat_stream(generating.events(), head, params.stop)
            return streamed(events, generating, routed)
        with answering(routed):
            generation = worker.generate(prompt_ids, routed.key, params, streamed=False).result()
        payload = openai.chat_completion(
            head, prompt_ids, generation, params.stop, body.return_token_ids
        )
        return MintJSONResponse(payload, headers=routed.headers)

    @app.post("/v1/feedback")
    def feedback(body: FeedbackRequest, who: Principal) -> dict[str, object]:
        """A client's score of one answer, by its request id: one per answer, from the
        principal that asked."""
        served = worker.outcomes.score(body.request_id, body.score, who)
        return {"request_id": body.request_id, "revision": served, "score": body.score}

    @app.get("/v1/models")
    def models(who: Principal) -> dict[str, object]:
        revisions = [str(r) for r in worker.ready_revisions(who)]
        return openai.models(base_id, revisions, int(time.time()))

    # One base URL per revision reference: the handlers above, with the revision the path names.
    adapter_api = APIRouter(prefix=ADAPTER_PREFIX)

    def tgi_as(ref: str, body: tgi.GenerateRequest) -> tgi.GenerateRequest:
        adapter_id = adapter_of_url(ref, body.parameters.adapter_id)
        parameters = body.parameters.model_copy(update={"adapter_id": adapter_id})
        return body.model_copy(update={"parameters": parameters})

    def openai_as(ref: str, body: _OpenAI) -> _OpenAI:
        return body.model_copy(update={"model": adapter_of_url(ref, body.model)})

    @adapter_api.post("", response_model=None)
    @adapter_api.post("/", response_model=None)
    def adapter_tgi_compat(ref: str, body: tgi.GenerateRequest, who: Principal) -> Response:
        return tgi_compat(tgi_as(ref, body), who)

    @adapter_api.post("/generate")
    def adapter_generate(ref: str, body: tgi.GenerateRequest, who: Principal) -> MintJSONResponse:
        return generate(tgi_as(ref, body), who)

    @adapter_api.post("/generate_stream")
    def adapter_generate_stream(
        ref: str, body: tgi.GenerateRequest, who: Principal
    ) -> StreamingResponse:
        return generate_stream(tgi_as(ref, body), who)

    @adapter_api.post("/v1/completions", response_model=None)
    def adapter_completions(ref: str, body: openai.CompletionRequest, who: Principal) -> Response:
        return completions(openai_as(ref, body), who)

    @adapter_api.post("/v1/chat/completions", response_model=None)
    def adapter_chat_completions(ref: str, body: openai.ChatRequest, who: Principal) -> Response:
        return chat_completions(openai_as(ref, body), who)

    app.include_router(adapter_api)

    # MinT.

    @app.get("/health")
    def health() -> dict[str, object]:
        """`ok`, or `degraded` while the registry cannot be reached (serving goes on) or the
        engine is down (being restarted); the backend, and the base it serves: model id,
        weights digest, family and context length."""
        return {
            "status": "degraded" if worker.degraded else "ok",
            "degraded_reason": worker.degraded,
            "last_sync": worker.catalog.last_sync,
            "backend": worker.backend.kind,
            "base_model": base_id,
            "base_digest": worker.base.digest,
            "base_family": worker.base.family,
            "context_length": context_length,
            "queue_depth": worker.queue_depth,
            "batch_size": worker.batch_size,
            "request_path_loads": worker.request_path_loads,
            # Aliases moved outside the pipeline: each serves the pipeline's last target.
            "held_alias_moves": [move.to_json() for move in worker.held_moves],
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
        revision = RevisionId(check_adapter_name(body.adapter), body.revision)
        return entry_json(worker.admit_known(revision, Priority[body.priority.upper()]))

    @admin_api.post("/sync", status_code=202)
    def sync() -> dict[str, object]:
        """Catch up with the registry now (activation calls it after moving an alias)."""
        return {"admitted": [str(r) for r in worker.sync()]}

    @admin_api.get("/routing")
    def routing() -> dict[str, object]:
        """What `mint gateway` routes by: the base, the ready revisions, the engine keys in
        device slots (adapter affinity) and the load."""
        ready, slots = worker.routing()
        return {
            "base_model": base_id,
            "base_digest": worker.base.digest,
            "ready": [str(r) for r in ready],
            "device_slots": slots,
            "in_flight": worker.queue_depth + worker.batch_size,
            "degraded_reason": worker.degraded,
        }

    @admin_api.get("/events")
    def events() -> dict[str, object]:
        """Every readiness change on this worker since it started, oldest first; and every
        held alias move that appeared or ended."""
        return {
            "events": [
                {"at": e.since, "id": str(e.revision), "state": e.state.value, "reason": e.reason}
                for e in worker.events()
            ],
            "alias_events": [
                {"at": e.at, "kind": e.kind.value, **e.move.to_json()}
                for e in worker.alias_events()
            ],
        }

    @admin_api.get("/outcomes")
    def outcomes(since: Annotated[float, Query(ge=0)] = 0.0) -> dict[str, object]:
        """Per revision, the requests answered at or after `since` (Unix time): requests,
        errors and their rate, p50/p95 latency in seconds, feedback and its mean score. What a
        canary is watched by."""
        summary = worker.outcomes.summary(since)
        return {"since": since, "revisions": {name: o.to_json() for name, o in summary.items()}}

    app.include_router(admin_api)
    return app
