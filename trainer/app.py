"""The Tinker API over HTTP: the routes the `tinker` SDK (0.38) calls, under `/api/v1`.

Every route is a POST with a JSON body, except `GET /api/v1/samplers/{id}` and the protobuf
body of `forward_backward`/`forward`. A call that does work answers a future (`request_id`) at
once; the SDK polls `retrieve_future`, which answers the result (protobuf for forward/backward
and sampling, JSON otherwise), `try_again` after a long poll, or an error with its category.
A bad request fails its future, never the HTTP call: the SDK resends a 5xx submit without limit,
so nothing here answers 5xx for a request's own fault. A full queue is a 429 (the SDK waits and
sends it again).

Naming: `user_metadata={"mint_adapter": name}` names the MinT adapter whose revisions a
model's sampler weights become, wherever the SDK sends it: `ServiceClient(user_metadata=...)`
(its session: every model's default), `create_lora_training_client`,
`create_training_client_from_state[_with_optimizer]` (the model), `save_weights_for_sampler`
(that save alone); the narrower one wins.

Auth: the `X-API-Key` header names the principal through `MINT_API_KEYS` (the SDK only sends
keys starting `tml-`); without configured keys, every caller is `anonymous`.
"""

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from mint_core.access import ANONYMOUS
from mint_core.errors import AuthenticationError, ConfigurationError, MintError, NotFoundError
from trainer.checkpoints import CheckpointPath
from trainer.futures import Failure, Futures
from trainer.lora import Targets
from trainer.records import AdamParams, SamplerSave
from trainer.sequencing import Op, OpKind
from trainer.service import QueueFull, Trainer
from trainer.wire import PROTOBUF, read_forward_backward

log = logging.getLogger(__name__)
SUPPORTED_SDK = ">=0.38,<0.39"
"""The `tinker` SDK versions whose wire protocol this API speaks."""

Handler = Callable[[Request, str], Awaitable[Any]]


def create_app(make_trainer: Callable[[Futures], Trainer], api_keys: Mapping[str, str]) -> FastAPI:
    """The API of the trainer `make_trainer` builds (at start-up, on the server's loop)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # type: ignore[no-untyped-def]
        futures = Futures(asyncio.get_running_loop())
        app.state.futures = futures
        app.state.trainer = await asyncio.to_thread(make_trainer, futures)
        try:
            yield
        finally:
            await asyncio.to_thread(app.state.trainer.stop)

    app = FastAPI(title="mint trainer (Tinker API)", lifespan=lifespan)
    calls: dict[str, int] = {}
    """Requests per API route since start (`/health` shows them)."""

    def principal(request: Request) -> str:
        key = request.headers.get("x-api-key")
        if not api_keys:
            return ANONYMOUS
        if key is None or key not in api_keys:
            raise AuthenticationError("the X-API-Key is not known to this trainer")
        return api_keys[key]

    def route(path: str, method: str = "POST") -> Callable[[Handler], Handler]:
        def register(handler: Handler) -> Handler:
            async def endpoint(request: Request) -> Response:
                calls[path] = calls.get(path, 0) + 1
                try:
                    who = principal(request)
                    answer = await handler(request, who)
                except AuthenticationError as e:
                    return JSONResponse({"detail": str(e)}, status_code=401)
                except QueueFull as e:
                    return JSONResponse({"detail": str(e)}, status_code=429)
                except NotFoundError as e:
                    return JSONResponse({"detail": str(e)}, status_code=404)
                except MintError as e:
                    return JSONResponse({"detail": str(e)}, status_code=400)
                except (KeyError, TypeError, ValueError) as e:  # a body the SDK would not send
                    return JSONResponse({"detail": f"malformed request: {e!r}"}, status_code=400)
                return answer if isinstance(answer, Response) else JSONResponse(answer)

            app.add_api_route(f"/api/v1/{path}", endpoint, methods=[method], name=path)
            return handler

        return register

    def trainer() -> Trainer:
        return app.state.trainer  # type: ignore[no-any-return]

    def futures() -> Futures:
        return app.state.futures  # type: ignore[no-any-return]

    def future(who: str, work: Callable[[str], None]) -> dict[str, object]:
        """A new future; `work(request_id)` queues what finishes it, or fails it at once."""
        request_id = futures().create(who)
        try:
            work(request_id)
        except QueueFull:
            raise
        except MintError as e:
            futures().fail(request_id, str(e))
        except (KeyError, TypeError, ValueError) as e:
            futures().fail(request_id, f"malformed request: {e!r}")
        return {"request_id": request_id}

    @route("healthz", "GET")
    async def healthz(request: Request, who: str) -> dict[str, object]:
        return {"status": "ok"}

    @app.get("/health")
    async def health() -> dict[str, object]:
        """What MinT's process starter waits for (the base is loaded by then)."""
        text = app.state.trainer.base.text
        return {
            "status": "ok",
            "base": {"model_id": text.model_id, "digest": text.digest},
            "sdk": SUPPORTED_SDK,
            "sessions": len(app.state.trainer.sessions),
            "models": len(app.state.trainer.models),
            "pending": app.state.futures.pending(),
            "calls": calls,
        }

    @route("client/config")
    async def client_config(request: Request, who: str) -> dict[str, object]:
        # The older transport (plain httpx), API keys without JWT exchange, and the features
        # this trainer serves: client-side custom losses, per-request future polling.
        return {
            "pjwt_auth_enabled": False,
            "use_pyqwest_transport": False,
            "proto_compress_fwdbwd": False,
            "sample_use_retrieve_futures": False,
            "custom_loss_server_side": False,
            "sample_join_sampling_session": False,
        }

    @route("client/dynamic_config")
    async def dynamic_config(request: Request, who: str) -> dict[str, object]:
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @route("get_server_capabilities", "GET")
    async def capabilities(request: Request, who: str) -> dict[str, object]:
        text = trainer().base.text
        return {
            "supported_models": [
                {
                    "model_name": text.name_or_path,
                    "max_context_length": text.context_length,
                    "trainable": True,
                    "sampleable": True,
                }
            ]
        }

    @route("create_session")
    async def create_session(request: Request, who: str) -> dict[str, object]:
        body = await request.json()
        session = trainer().create_session(who, mint_adapter(body))
        return {"type": "create_session", "session_id": session.id}

    @route("session_heartbeat")
    async def heartbeat(request: Request, who: str) -> dict[str, object]:
        body = await request.json()
        trainer().session(body["session_id"], who)
        return {"type": "session_heartbeat"}

    @route("telemetry")
    async def telemetry(request: Request, who: str) -> dict[str, object]:
        return {"status": "accepted"}  # the SDK's telemetry is not kept

    @route("sessions/{session_id}/finish")
    async def finish(request: Request, who: str) -> Response:
        body = await request.json()
        reason = (body.get("reason") or {}).get("type", "")
        trainer().finish_session(request.path_params["session_id"], who, reason)
        return Response(status_code=200)

    @route("create_model")
    async def create_model(request: Request, who: str) -> dict[str, object]:
        body = await request.json()

        def work(request_id: str) -> None:
            lora = body.get("lora_config") or {}
            optimizer = (body.get("optimizer_config") or {}).get("type", "adamw")
            if optimizer != "adamw":
                raise ConfigurationError(f"optimizer {optimizer!r}: mint trainer runs AdamW only")
            model = trainer().create_model(
                body["session_id"],
                int(body["model_seq_id"]),
                who,
                body["base_model"],
                int(lora.get("rank", 32)),
                Targets(
                    bool(lora.get("train_attn", True)),
                    bool(lora.get("train_mlp", True)),
                    bool(lora.get("train_unembed", True)),
                ),
                lora.get("seed"),
                mint_adapter(body),
            )
            futures().finish(request_id, {"model_id": model.id, "type": "create_model"})

        return await asyncio.to_thread(future, who, work)  # reads the store, builds a LoRA

    @route("get_info")
    async def get_info(request: Request, who: str) -> dict[str, object]:
        body = await request.json()
        model = trainer().model(body["model_id"], who)
        text = trainer().base.text
        return {
            "type": "get_info",
            "model_id": model.id,
            "model_data": {
                "arch": text.family,
                "model_name": model.base_model,
                "tokenizer_id": text.name_or_path,
            },
            "is_lora": True,
            "lora_rank": model.lora.rank,
            "model_name": model.base_model,
        }

    def queue(who: str, kind: OpKind, payload: Any, body: Mapping[str, Any]) -> dict[str, object]:
        """A future for `body`'s request, queued on its model in its `seq_id` order."""

        def work(request_id: str) -> None:
            model = trainer().model(body["model_id"], who)
            trainer().submit(model, Op(int(body.get("seq_id") or 0), kind, request_id, payload))

        return future(who, work)

    @route("forward_backward")
    async def forward_backward(request: Request, who: str) -> dict[str, object]:
        """Also `forward`: the SDK sends both here, the latter with `forward_only`."""
        raw = await request.body()
        encoding = request.headers.get("content-encoding")

        def work(request_id: str) -> None:
            message = read_forward_backward(raw, encoding)
            model = trainer().model(message.model_id, who)
            trainer().submit(model, Op(message.seq_id, OpKind.FORWARD, request_id, message))

        return future(who, work)

    @route("optim_step")
    async def optim_step(request: Request, who: str) -> dict[str, object]:
        body = await request.json()
        given = body.get("adam_params") or body.get("optim_params") or {}
        if "type" in given and given["type"] != "adam":
            raise ConfigurationError(f"optimizer {given['type']!r}: mint trainer runs AdamW only")
        known = AdamParams.__dataclass_fields__
        params = AdamParams(**{k: float(v) for k, v in given.items() if k in known})
        return queue(who, OpKind.OPTIM, params, body)

    @route("save_weights")
    async def save_weights(request: Request, who: str) -> dict[str, object]:
        body = await request.json()
        return queue(who, OpKind.SAVE_STATE, body.get("path") or "state", body)

    @route("load_weights")
    async def load_weights(request: Request, who: str) -> dict[str, object]:
        body = await request.json()
        optimizer = bool(body.get("optimizer"))
        if body.get("session_id") is not None:  # create-via-load: the model's first request

            def work(request_id: str) -> None:
                path = CheckpointPath.parse(body["path"])
                model = trainer().create_from_state(
                    body["session_id"],
                    int(body["model_seq_id"]),
                    who,
                    path,
                    optimizer,
                    body.get("base_model"),
                    mint_adapter(body),
                )
                futures().finish(
                    request_id, {"path": str(path), "model_id": model.id, "type": "load_weights"}
                )

            return await asyncio.to_thread(future, who, work)  # reads the store, builds a LoRA
        path = CheckpointPath.parse(body["path"])
        return queue(who, OpKind.LOAD_STATE, (path, optimizer), body)

    @route("save_weights_for_sampler")
    async def save_for_sampler(request: Request, who: str) -> dict[str, object]:
        body = await request.json()
        save = SamplerSave(
            body.get("path"), body.get("sampling_session_seq_id"), mint_adapter(body)
        )
        return queue(who, OpKind.SAVE_SAMPLER, save, body)

    @route("create_sampling_session")
    async def create_sampling_session(request: Request, who: str) -> dict[str, object]:
        body = await request.json()
        session = trainer().session(body["session_id"], who)
        sampler = await asyncio.to_thread(
            trainer().samplers.create,
            session,
            int(body["sampling_session_seq_id"]),
            body.get("model_path"),
            body.get("base_model"),
        )
        return {"type": "create_sampling_session", "sampling_session_id": sampler}

    @route("samplers/{sampler_id}", "GET")
    async def get_sampler(request: Request, who: str) -> dict[str, object]:
        sampler = trainer().samplers.get(request.path_params["sampler_id"], who)
        return {
            "sampler_id": sampler.id,
            "base_model": sampler.base_model,
            "model_path": sampler.model_path,
        }

    @route("asample")
    async def asample(request: Request, who: str) -> dict[str, object]:
        body = await request.json()
        n = int(body.get("num_samples") or 1)
        answer = future(
            who,
            lambda rid: trainer().samplers.sample(
                trainer().samplers.get(body["sampling_session_id"], who), body, rid
            ),
        )
        answer["sample_sequence_ids"] = [f"{answer['request_id']}:{i}" for i in range(n)]
        return answer

    @route("retrieve_future")
    async def retrieve_future(request: Request, who: str) -> Response:
        body = await request.json()
        request_id = body["request_id"]
        outcome = await futures().wait(request_id, who)
        if outcome is None:
            return JSONResponse(
                {"type": "try_again", "request_id": request_id, "queue_state": "active"}
            )
        if isinstance(outcome, Failure):
            return JSONResponse({"error": outcome.message, "category": outcome.category.value})
        if isinstance(outcome, bytes):
            return Response(outcome, media_type=PROTOBUF)
        return JSONResponse(outcome)

    return app


def mint_adapter(body: Mapping[str, Any]) -> str | None:
    """The MinT adapter a request's `user_metadata` names (`{"mint_adapter": name}`), if any."""
    name = (body.get("user_metadata") or {}).get("mint_adapter")
    return None if name is None else str(name)
