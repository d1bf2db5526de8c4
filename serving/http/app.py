"""The worker's HTTP API: `create_app` puts the routers of `serving.http` together over one
worker, with its API keys, its limits and its one error table (`serving.http.errors`).

The routers: TGI (`serving.http.tgi`) and OpenAI (`serving.http.openai`), both also under each
revision reference's own base URL, `/adapters/{ref}`, for clients that cannot name a revision;
MinT's status (`/v1/adapters/{name}`, `/health`, `/metrics`: `serving.http.status`), feedback
(`serving.http.outcomes`) and the admin endpoints (`serving.http.admin`), which need an admin's
key whenever the worker has API keys. What each route answers, with which headers
(`X-Mint-Revision`, `X-Mint-Request-Id`), errors and limits: the README, "Running the pieces"
(feedback: "Gates").
"""

from collections.abc import AsyncIterator, Collection, Mapping
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from mint_core.access import ADMIN
from mint_core.tenancy import Limiter, TenancyFile
from serving.http import admin, openai, outcomes, status, tgi
from serving.http.common import MintJSONResponse
from serving.http.context import Access, WorkerAPI
from serving.http.errors import install_error_handlers
from serving.http.limits import MAX_REQUEST_BYTES, BodyLimit
from serving.protocols.tgi import special_ids
from serving.worker.leaving import Drain, DrainPlan

__all__ = ["HANDLER_THREADS", "create_app"]

HANDLER_THREADS = 256
"""Blocking handlers (each waits on its generation) run in threads: allow many at once."""


def create_app(
    worker: WorkerAPI,
    api_keys: Mapping[str, str] | None = None,
    admin_principals: Collection[str] = (ADMIN,),
    max_request_bytes: int = MAX_REQUEST_BYTES,
    tenancy: TenancyFile | None = None,
    drain: Drain | None = None,
) -> FastAPI:
    """The worker's API. With `api_keys`, `Authorization: Bearer <key>` names the principal
    (no header: anonymous); without, every request is anonymous and the header is ignored.

    With keys, the admin endpoints take only principals in `admin_principals`, and
    `/v1/adapters/{name}` shows a caller the revisions its policy records let it use (admins:
    all of them, as the pipeline reads readiness with its admin key); admins may also generate
    with every revision (the evaluation gate scores each team's). Without keys there is no
    telling callers apart: both are open to all, as before keys existed. `tenancy`: each
    principal's quota, enforced on every generation route (none: no quotas). `drain`: the
    worker process's departure, which counts the requests it has (none: it never leaves)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        anyio.to_thread.current_default_thread_limiter().total_tokens = HANDLER_THREADS
        yield

    app = FastAPI(
        title="MinT serving worker", lifespan=lifespan, default_response_class=MintJSONResponse
    )
    drain = drain or Drain(DrainPlan(0.0, 0.0))
    app.add_middleware(BodyLimit, limit=max_request_bytes)
    app.add_middleware(Arrivals, drain=drain)
    app.state.worker = worker
    app.state.drain = drain
    app.state.access = Access(dict(api_keys or {}), frozenset(admin_principals))
    app.state.limiter = Limiter((tenancy or TenancyFile(None)).current)
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


class Arrivals:
    """Counts the requests the worker has for its drain (`serving.worker.leaving`): every
    POST (generations, feedback, admin asks) until its answer, a stream's too, has been sent;
    not the probes (`/health`, `/admin/routing`, `/metrics`), which go on while it leaves."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        self.drain.arrived()
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.finished()
