"""The worker's HTTP API: `create_app` puts the routers of `serving.http` together over one
worker, with its API keys, its limits and its one error table.

- TGI (`serving.http.tgi`): `POST /generate`, `POST /generate_stream`, `POST /`.
- OpenAI (`serving.http.openai`): `/v1/completions`, `/v1/chat/completions`, `/v1/models`.
- Per revision reference, a base URL of its own, `/adapters/{ref}` (`ref`: `name@alias` or
  `name:rN`): every generation route above under it responds as that revision, for clients
  that cannot name one, such as TGI's own `text-generation` client (it posts to its base URL
  and sends every chat with `model` "tgi"). A body that names another revision is refused
  (422) rather than either being chosen silently.
- MinT: `GET /v1/adapters/{name}`, `/health`, `/metrics` (`serving.http.status`),
  `POST /v1/feedback` (`serving.http.outcomes`), and the admin endpoints under `/admin`
  (admit, sync, routing, events: `serving.http.admin`; outcomes), which need a key of an
  admin principal whenever the worker has API keys.

Generation responses carry `X-Mint-Revision`: what served them, the exact revision or the
base's model id, chosen once per request (a canary's share included), streams and
multi-prompt completions too; and `X-Mint-Request-Id`, which OpenAI responses also carry as
their `id`: what feedback names. Each response's outcome is kept per revision
(`serving.worker.outcomes`).

Errors, inside streams too, are JSON in TGI's shape, `error` and `error_type`, with the status
codes of `serving.http.errors`.

Hostile input is refused early, each time naming the limit: a body over `max_request_bytes`
answers 413 (declared or not: a chunked body is counted as it arrives), so no prompt costs an
unbounded tokenization; new tokens the base's context cannot hold, and more than
`openai.MAX_PROMPTS` prompts in one completion, answer 422 before any prompt is tokenized; a
prompt that does not fit the context with its new tokens answers 422 with both numbers.

Prompts are the base's own tokens (its tokenizer, its chat template). Streamed text comes in
the pieces of an incremental detokenizer, which add up to exactly the text a non-streamed
response holds.
"""

from collections.abc import AsyncIterator, Collection, Mapping
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI

from mint_core.access import ADMIN
from serving.http import admin, openai, outcomes, status, tgi
from serving.http.common import MintJSONResponse
from serving.http.context import Access, WorkerAPI
from serving.http.errors import install_error_handlers
from serving.http.limits import MAX_REQUEST_BYTES, BodyLimit
from serving.protocols.tgi import special_ids

__all__ = ["HANDLER_THREADS", "create_app"]

HANDLER_THREADS = 256
"""Blocking handlers (each waits on its generation) run in threads: allow many at once."""


def create_app(
    worker: WorkerAPI,
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
    app.state.worker = worker
    app.state.access = Access(dict(api_keys or {}), frozenset(admin_principals))
    app.state.tgi_special_ids = special_ids(worker.codec)
    install_error_handlers(app, "worker")
    for router in (
        tgi.router,
        openai.router,
        outcomes.router,
        tgi.adapter_router,
        openai.adapter_router,
        status.router,
        admin.router,
        outcomes.admin_router,
    ):
        app.include_router(router)
    return app
