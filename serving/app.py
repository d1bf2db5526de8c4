"""The worker's HTTP API: TGI's `/generate`, OpenAI's `/v1/completions` and `/v1/models`,
adapter readiness, admission and health.

Errors are JSON in TGI's shape (`error`, `error_type`) plus the names that explain them:
unknown adapter -> 404, not ready -> 503 with Retry-After, bad request -> 422.
"""

import time
import uuid
from collections.abc import Mapping
from typing import Annotated, Literal

from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from mint_core.access import ANONYMOUS, principal_for
from mint_core.errors import (
    AccessDeniedError,
    AuthenticationError,
    ConfigurationError,
    NotFoundError,
    RegistryError,
)
from mint_core.revisions import RevisionId, RevisionRef, check_adapter_name
from mint_core.textgen import Generation
from serving.worker import ReadinessEntry, RevisionNotReady, Worker

RETRY_AFTER_S = 1
REVISION_HEADER = "X-Mint-Revision"


class GenerateParameters(BaseModel):
    """TGI's generation parameters; fields TGI clients send that greedy decoding ignores are
    accepted and dropped."""

    model_config = ConfigDict(extra="ignore")

    adapter_id: str | None = None
    max_new_tokens: int = Field(20, ge=1, le=60)
    details: bool = False
    do_sample: bool = False
    temperature: float | None = Field(None, ge=0)


class GenerateRequest(BaseModel):
    inputs: str
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    prompt: str | list[str]
    max_tokens: int = Field(16, ge=1, le=60)
    temperature: float | None = Field(None, ge=0)


class AdmitRequest(BaseModel):
    adapter: str
    revision: int = Field(ge=1)


def _error(status: int, error_type: str, message: str, **names: object) -> JSONResponse:
    return JSONResponse({"error": message, "error_type": error_type, **names}, status_code=status)


def entry_json(entry: ReadinessEntry) -> dict[str, object]:
    return {
        "id": str(entry.revision),
        "adapter": entry.revision.adapter,
        "revision": entry.revision.number,
        "state": entry.state.value,
        "since": entry.since,
        "reason": entry.reason,
    }


def _refuse_sampling(do_sample: bool, temperature: float | None) -> None:
    if do_sample or (temperature or 0) > 0:
        raise ConfigurationError(
            f"sampling (do_sample={do_sample}, temperature={temperature}) is not available on "
            "this worker; it decodes greedily: send do_sample=false and temperature 0 or none"
        )


def create_app(worker: Worker, api_keys: Mapping[str, str] | None = None) -> FastAPI:
    """The worker's API. With `api_keys`, `Authorization: Bearer <key>` names the principal
    (no header: anonymous); without, every request is anonymous and the header is ignored."""
    app = FastAPI(title="MinT serving worker")
    engine = worker.engine
    base_id = engine.base.model_id
    keys = dict(api_keys or {})

    def principal(authorization: Annotated[str | None, Header()] = None) -> str:
        if not keys or authorization is None:
            return ANONYMOUS
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthenticationError("send the API key as 'Authorization: Bearer <key>'")
        return principal_for(keys, key.strip())

    Principal = Annotated[str, Depends(principal)]

    @app.exception_handler(AuthenticationError)
    def unauthenticated(_: Request, e: AuthenticationError) -> JSONResponse:
        response = _error(401, "unauthenticated", str(e))
        response.headers["WWW-Authenticate"] = "Bearer"
        return response

    @app.exception_handler(AccessDeniedError)
    def forbidden(_: Request, e: AccessDeniedError) -> JSONResponse:
        return _error(403, "forbidden", str(e))

    @app.exception_handler(NotFoundError)
    def not_found(_: Request, e: NotFoundError) -> JSONResponse:
        return _error(404, "not_found", str(e))

    @app.exception_handler(RevisionNotReady)
    def not_ready(_: Request, e: RevisionNotReady) -> JSONResponse:
        response = _error(503, "not_ready", str(e), **entry_json(e.entry))
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response

    @app.exception_handler(ConfigurationError)
    def bad_value(_: Request, e: ConfigurationError) -> JSONResponse:
        return _error(422, "validation", str(e))

    @app.exception_handler(RegistryError)
    def registry_down(_: Request, e: RegistryError) -> JSONResponse:
        response = _error(503, "registry_unavailable", str(e))
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response

    def run(
        prompt: str, ref: RevisionRef | None, max_new_tokens: int, who: str
    ) -> tuple[str, Generation]:
        revision, key = worker.route(ref, who)
        prompt_tokens = len(engine.tokenizer.encode(prompt))
        limit = engine.base.spec.max_positions
        if prompt_tokens + max_new_tokens > limit:
            raise ConfigurationError(
                f"prompt of {prompt_tokens} tokens plus max_new_tokens={max_new_tokens} exceeds "
                f"the base model's {limit} positions; shorten the prompt or ask for fewer tokens"
            )
        generation = engine.generate([prompt], [key], max_new_tokens)[0]
        return (str(revision) if revision else base_id), generation

    @app.get("/health")
    def health() -> dict[str, object]:
        return {"status": "ok", "base_model": base_id, "base_digest": engine.base.digest}

    @app.post("/generate")
    def generate(body: GenerateRequest, who: Principal) -> JSONResponse:
        params = body.parameters
        _refuse_sampling(params.do_sample, params.temperature)
        ref = RevisionRef.parse(params.adapter_id) if params.adapter_id else None
        served, generation = run(body.inputs, ref, params.max_new_tokens, who)
        payload: dict[str, object] = {"generated_text": generation.text}
        if params.details:
            payload["details"] = {
                "finish_reason": "eos_token" if generation.finished else "length",
                "generated_tokens": len(generation.token_ids),
                "seed": None,
                "prefill": [],
                "tokens": [
                    {
                        "id": token,
                        "text": engine.tokenizer.token_text(token),
                        "logprob": logprob,
                        "special": token < 32,
                    }
                    for token, logprob in zip(
                        generation.token_ids, generation.logprobs, strict=True
                    )
                ],
            }
        return JSONResponse(payload, headers={REVISION_HEADER: served})

    @app.post("/v1/completions")
    def completions(body: CompletionRequest, who: Principal) -> JSONResponse:
        _refuse_sampling(False, body.temperature)
        ref = None if body.model in (base_id, "base") else RevisionRef.parse(body.model)
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        choices = []
        served = base_id
        usage = {"prompt_tokens": 0, "completion_tokens": 0}
        for index, prompt in enumerate(prompts):
            served, generation = run(prompt, ref, body.max_tokens, who)
            finish: Literal["stop", "length"] = "stop" if generation.finished else "length"
            choices.append(
                {"index": index, "text": generation.text, "logprobs": None, "finish_reason": finish}
            )
            usage["prompt_tokens"] += len(engine.tokenizer.encode(prompt))
            usage["completion_tokens"] += len(generation.token_ids)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        payload = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": served,
            "choices": choices,
            "usage": usage,
        }
        return JSONResponse(payload, headers={REVISION_HEADER: served})

    @app.get("/v1/models")
    def models(who: Principal) -> dict[str, object]:
        now = int(time.time())
        data = [{"id": base_id, "object": "model", "created": now, "owned_by": "mint"}]
        data += [
            {"id": str(r), "object": "model", "created": now, "owned_by": "mint", "parent": base_id}
            for r in worker.ready_revisions(who)
        ]
        return {"object": "list", "data": data}

    @app.get("/v1/adapters/{name}")
    def adapter_status(name: str) -> dict[str, object]:
        check_adapter_name(name)
        entries = worker.entries(name)
        if not entries and name not in worker.registry.adapters():
            raise NotFoundError(f"adapter {name!r} is not registered")
        return {"adapter": name, "revisions": [entry_json(e) for e in entries]}

    @app.post("/admin/admit", status_code=202)
    def admit(body: AdmitRequest) -> dict[str, object]:
        revision = worker.registry.get(
            RevisionId(check_adapter_name(body.adapter), body.revision)
        ).id
        return entry_json(worker.admit(revision))

    return app
