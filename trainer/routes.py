"""The Tinker API over HTTP: the routes the `tinker` SDK (0.38) calls, under `/api/v1`, and
`/health`.

Each route takes its body as the SDK sends it (`trainer.bodies`; the protobuf of
`forward_backward`/`forward`: `trainer.wire`), refused with a 422 naming the field before any
work, and answers JSON, or a future (`request_id`) that its work finishes or fails, which the
SDK polls with `retrieve_future`. Errors answer from MinT's one table (`trainer.errors`), a
future's failure with its category. What each answer tells the SDK, keys and adapter names:
the README, "Training as a service: the Tinker API".
"""

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from mint_core.errors import ConfigurationError
from serving.http.errors import shorten
from trainer import bodies
from trainer.bodies import mint_adapter
from trainer.checkpoints import CheckpointPath
from trainer.context import (
    CallCounts,
    CurrentFutures,
    CurrentTrainer,
    MaxRequestBytes,
    Principal,
    future,
    principal,
)
from trainer.futures import Failure, Futures
from trainer.lora import Targets
from trainer.records import AdamParams, SamplerSave
from trainer.sequencing import Op, OpKind
from trainer.service import Trainer
from trainer.wire import PROTOBUF, read_forward_backward

SUPPORTED_SDK = ">=0.38,<0.39"
"""The `tinker` SDK versions whose wire protocol this API speaks."""

router = APIRouter(prefix="/api/v1", dependencies=[Depends(principal)])
health_router = APIRouter()
"""What is not the Tinker API: no API key, not counted."""

FORWARD_BACKWARD_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": "The SDK's `ForwardBackwardRequest` (tinker.proto), serialized; "
        "zstd-compressed with `content-encoding: zstd`.",
        "content": {PROTOBUF: {"schema": {"type": "string", "format": "binary"}}},
    }
}


@health_router.get("/health")
async def health(
    trainer: CurrentTrainer, futures: CurrentFutures, calls: CallCounts
) -> dict[str, object]:
    """What MinT's process starter waits for (the base is loaded by then)."""
    text = trainer.base.text
    return {
        "status": "ok",
        "base": {"model_id": text.model_id, "digest": text.digest},
        "sdk": SUPPORTED_SDK,
        "sessions": len(trainer.sessions),
        "models": len(trainer.models),
        "pending": futures.pending(),
        "calls": calls,
    }


@router.get("/healthz", name="healthz")
async def healthz() -> dict[str, object]:
    return {"status": "ok"}


@router.post("/client/config", name="client/config")
async def client_config() -> dict[str, object]:
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


@router.post("/client/dynamic_config", name="client/dynamic_config")
async def dynamic_config() -> dict[str, object]:
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


@router.get("/get_server_capabilities", name="get_server_capabilities")
async def capabilities(trainer: CurrentTrainer) -> dict[str, object]:
    text = trainer.base.text
    model = {
        "model_name": text.name_or_path,
        "max_context_length": text.context_length,
        "trainable": True,
        "sampleable": True,
    }
    return {"supported_models": [model]}


@router.post("/create_session", name="create_session")
async def create_session(
    body: bodies.CreateSession, who: Principal, trainer: CurrentTrainer
) -> dict[str, object]:
    session = trainer.create_session(who, mint_adapter(body.user_metadata))
    return {"type": "create_session", "session_id": session.id}


@router.post("/session_heartbeat", name="session_heartbeat")
async def heartbeat(
    body: bodies.SessionHeartbeat, who: Principal, trainer: CurrentTrainer
) -> object:
    trainer.session(body.session_id, who)
    return {"type": "session_heartbeat"}


@router.post("/telemetry", name="telemetry")
async def telemetry(body: bodies.Telemetry) -> dict[str, object]:
    return {"status": "accepted"}  # the SDK's telemetry is not kept


@router.post("/sessions/{session_id}/finish", name="sessions/{session_id}/finish")
async def finish(
    session_id: Annotated[str, bodies.StringConstraints(max_length=bodies.MAX_ID)],
    body: bodies.FinishSession,
    who: Principal,
    trainer: CurrentTrainer,
) -> Response:
    trainer.finish_session(session_id, who, body.reason.type if body.reason else "")
    return Response(status_code=200)


@router.post("/create_model", name="create_model")
async def create_model(
    body: bodies.CreateModel, who: Principal, trainer: CurrentTrainer, futures: CurrentFutures
) -> dict[str, object]:
    def work(request_id: str) -> None:
        lora = body.lora_config or bodies.LoraConfig()
        optimizer = (body.optimizer_config or bodies.OptimizerConfig()).type
        if optimizer != "adamw":
            raise ConfigurationError(f"optimizer {optimizer!r}: mint trainer runs AdamW only")
        model = trainer.create_model(
            body.session_id,
            body.model_seq_id,
            who,
            body.base_model,
            lora.rank,
            Targets(lora.train_attn, lora.train_mlp, lora.train_unembed),
            lora.seed,
            mint_adapter(body.user_metadata),
        )
        futures.finish(request_id, {"model_id": model.id, "type": "create_model"})

    return await asyncio.to_thread(future, futures, who, work)  # reads the store, builds a LoRA


@router.post("/get_info", name="get_info")
async def get_info(
    body: bodies.GetInfo, who: Principal, trainer: CurrentTrainer
) -> dict[str, object]:
    model = trainer.model(body.model_id, who)
    text = trainer.base.text
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


def queue(
    trainer: Trainer,
    futures: Futures,
    who: str,
    kind: OpKind,
    payload: object,
    body: bodies.ModelRequest,
) -> dict[str, object]:
    """A future for `body`'s request, queued on its model in its `seq_id` order."""

    def work(request_id: str) -> None:
        model = trainer.model(body.model_id, who)
        trainer.submit(model, Op(body.seq_id or 0, kind, request_id, payload))

    return future(futures, who, work)


@router.post("/forward_backward", name="forward_backward", openapi_extra=FORWARD_BACKWARD_BODY)
async def forward_backward(
    request: Request,
    who: Principal,
    trainer: CurrentTrainer,
    futures: CurrentFutures,
    limit: MaxRequestBytes,
) -> dict[str, object]:
    """Also `forward`: the SDK sends both here, the latter with `forward_only`."""
    # Read (and decompressed, within the body limit) before any future: a body that is not a
    # ForwardBackwardRequest is refused at once.
    raw = await request.body()
    message = await asyncio.to_thread(
        read_forward_backward, raw, request.headers.get("content-encoding"), limit
    )

    def work(request_id: str) -> None:
        model = trainer.model(message.model_id, who)
        trainer.submit(model, Op(message.seq_id, OpKind.FORWARD, request_id, message))

    return future(futures, who, work)


@router.post("/optim_step", name="optim_step")
async def optim_step(
    body: bodies.OptimStep, who: Principal, trainer: CurrentTrainer, futures: CurrentFutures
) -> dict[str, object]:
    given = body.params
    if given.type not in (None, "adam", "adamw"):
        raise ConfigurationError(f"optimizer {given.type!r}: mint trainer runs AdamW only")
    params = AdamParams(
        given.learning_rate,
        given.beta1,
        given.beta2,
        given.eps,
        given.weight_decay,
        given.grad_clip_norm,
    )
    return queue(trainer, futures, who, OpKind.OPTIM, params, body)


@router.post("/save_weights", name="save_weights")
async def save_weights(
    body: bodies.SaveWeights, who: Principal, trainer: CurrentTrainer, futures: CurrentFutures
) -> dict[str, object]:
    return queue(trainer, futures, who, OpKind.SAVE_STATE, body.path or "state", body)


@router.post("/load_weights", name="load_weights")
async def load_weights(
    body: bodies.LoadWeights, who: Principal, trainer: CurrentTrainer, futures: CurrentFutures
) -> dict[str, object]:
    path = CheckpointPath.parse(body.path)
    if body.session_id is not None:  # create-via-load: the model's first request
        session_id, model_seq_id = body.session_id, body.model_seq_id or 0

        def work(request_id: str) -> None:
            model = trainer.create_from_state(
                session_id,
                model_seq_id,
                who,
                path,
                body.optimizer,
                body.base_model,
                mint_adapter(body.user_metadata),
            )
            answer = {"path": str(path), "model_id": model.id, "type": "load_weights"}
            futures.finish(request_id, answer)

        return await asyncio.to_thread(future, futures, who, work)  # reads the store
    if body.model_id is None:
        raise ConfigurationError("load_weights needs model_id (or session_id to create one)")
    request = bodies.ModelRequest(model_id=body.model_id, seq_id=body.seq_id)
    payload = (path, body.optimizer)
    return queue(trainer, futures, who, OpKind.LOAD_STATE, payload, request)


@router.post("/save_weights_for_sampler", name="save_weights_for_sampler")
async def save_for_sampler(
    body: bodies.SaveWeightsForSampler,
    who: Principal,
    trainer: CurrentTrainer,
    futures: CurrentFutures,
) -> dict[str, object]:
    save = SamplerSave(body.path, body.sampling_session_seq_id, mint_adapter(body.user_metadata))
    return queue(trainer, futures, who, OpKind.SAVE_SAMPLER, save, body)


@router.post("/create_sampling_session", name="create_sampling_session")
async def create_sampling_session(
    body: bodies.CreateSamplingSession, who: Principal, trainer: CurrentTrainer
) -> dict[str, object]:
    session = trainer.session(body.session_id, who)
    sampler = await asyncio.to_thread(
        trainer.samplers.create,
        session,
        body.sampling_session_seq_id,
        body.model_path,
        body.base_model,
    )
    return {"type": "create_sampling_session", "sampling_session_id": sampler}


@router.get("/samplers/{sampler_id}", name="samplers/{sampler_id}")
async def get_sampler(
    sampler_id: Annotated[str, bodies.StringConstraints(max_length=bodies.MAX_ID)],
    who: Principal,
    trainer: CurrentTrainer,
) -> dict[str, object]:
    sampler = trainer.samplers.get(sampler_id, who)
    return {
        "sampler_id": sampler.id,
        "base_model": sampler.base_model,
        "model_path": sampler.model_path,
    }


@router.post("/asample", name="asample")
async def asample(
    body: bodies.Sample, who: Principal, trainer: CurrentTrainer, futures: CurrentFutures
) -> dict[str, object]:
    request = body.model_dump()

    def work(request_id: str) -> None:
        sampler = trainer.samplers.get(body.sampling_session_id, who)
        trainer.samplers.sample(sampler, request, request_id)

    answer = future(futures, who, work)
    ids = [f"{answer['request_id']}:{i}" for i in range(body.num_samples)]
    return {**answer, "sample_sequence_ids": ids}


@router.post("/retrieve_future", name="retrieve_future")
async def retrieve_future(
    body: bodies.RetrieveFuture, who: Principal, futures: CurrentFutures
) -> Response:
    outcome = await futures.wait(body.request_id, who)
    if outcome is None:
        answer = {"type": "try_again", "request_id": body.request_id, "queue_state": "active"}
        return JSONResponse(answer)
    if isinstance(outcome, Failure):
        return JSONResponse({"error": shorten(outcome.message), "category": outcome.category})
    if isinstance(outcome, bytes):
        return Response(outcome, media_type=PROTOBUF)
    return JSONResponse(outcome)
