"""The trainer's app: the Tinker API (`trainer.routes`) behind MinT's error table and body
limit, over the trainer `make_trainer` builds at start-up."""

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager

from fastapi import FastAPI

from serving.http.errors import install_error_handlers
from serving.http.limits import BodyLimit
from trainer.errors import trainer_error
from trainer.futures import Futures
from trainer.routes import health_router, router
from trainer.service import Trainer
from trainer.wire import MAX_REQUEST_BYTES


def create_app(
    make_trainer: Callable[[Futures], Trainer],
    api_keys: Mapping[str, str],
    max_request_bytes: int = MAX_REQUEST_BYTES,
) -> FastAPI:
    """The API of the trainer `make_trainer` builds (at start-up, on the server's loop)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.futures = Futures(asyncio.get_running_loop())
        app.state.trainer = await asyncio.to_thread(make_trainer, app.state.futures)
        try:
            yield
        finally:
            await asyncio.to_thread(app.state.trainer.stop)

    app = FastAPI(title="mint trainer (Tinker API)", lifespan=lifespan)
    app.state.api_keys = dict(api_keys)
    app.state.calls = {}  # requests per API route since start (`/health` shows them)
    app.state.max_request_bytes = max_request_bytes
    install_error_handlers(app, "trainer", trainer_error)
    app.add_middleware(BodyLimit, limit=max_request_bytes)
    app.include_router(router)
    app.include_router(health_router)
    return app
