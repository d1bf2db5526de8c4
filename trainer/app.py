"""The Tinker API over HTTP: the routes the `tinker` SDK (0.38) calls, under `/api/v1`
(`trainer.routes`), and `/health`.

Every route is a POST with a JSON body (`trainer.bodies`), except `GET /api/v1/samplers/{id}`
and the protobuf body of `forward_backward`/`forward`. A call that does work answers a future
(`request_id`) at once; the SDK polls `retrieve_future`, which answers the result (protobuf for
forward/backward and sampling, JSON otherwise), `try_again` after a long poll, or an error with
its category. A body that is not the SDK's is a 422 naming the field; a request whose values
cannot run fails its future (category `user`); a full queue is a 429 (the SDK waits and sends
it again). Nothing answers 5xx for a request's own fault: the SDK resends a 5xx without limit.
Errors answer from MinT's one table (`trainer.errors`); a body over `max_request_bytes` is a
413 before anything reads it, a compressed one too once it would decompress past that.

Naming: `user_metadata={"mint_adapter": name}` names the MinT adapter whose revisions a
model's sampler weights become, wherever the SDK sends it: `ServiceClient(user_metadata=...)`
(its session: every model's default), `create_lora_training_client`,
`create_training_client_from_state[_with_optimizer]` (the model), `save_weights_for_sampler`
(that save alone); the narrower one wins.

Auth: the `X-API-Key` header names the principal through `MINT_API_KEYS` (the SDK only sends
keys starting `tml-`); without configured keys, every caller is `anonymous`.
"""

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request

from serving.http.errors import install_error_handlers
from serving.http.limits import BodyLimit
from trainer.errors import trainer_error
from trainer.futures import Futures
from trainer.routes import router
from trainer.service import Trainer
from trainer.wire import MAX_REQUEST_BYTES

SUPPORTED_SDK = ">=0.38,<0.39"
"""The `tinker` SDK versions whose wire protocol this API speaks."""


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
    app.add_api_route("/health", health, methods=["GET"])
    return app


async def health(request: Request) -> dict[str, object]:
    """What MinT's process starter waits for (the base is loaded by then)."""
    trainer: Trainer = request.app.state.trainer
    text = trainer.base.text
    return {
        "status": "ok",
        "base": {"model_id": text.model_id, "digest": text.digest},
        "sdk": SUPPORTED_SDK,
        "sessions": len(trainer.sessions),
        "models": len(trainer.models),
        "pending": request.app.state.futures.pending(),
        "calls": request.app.state.calls,
    }
