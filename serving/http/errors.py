"""The one table from what went wrong to the HTTP response, for the worker's API and the gateway.

Errors, whatever raised them (MinT, request validation, routing, a limit, a bug), have one
shape, TGI's: `error` and `error_type`, plus the names that explain them (`ErrorResponse`).
`error_response` is the table: unknown key 401, not allowed 403, unknown adapter or route 404,
a revision of another base 409, body over the size limit 413, malformed request 422, not ready
503 with Retry-After, anything unexpected 500 (details in the log only). Inside a stream, an
error is one last event of that shape.

Values echoed in messages are cut short (`shorten`): a caller may send anything, of any
length, and an error message is no place to send it all back.
"""

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from mint_core.errors import (
    AccessDeniedError,
    AuthenticationError,
    BaseMismatchError,
    ConfigurationError,
    EngineUnavailableError,
    MintError,
    NotFoundError,
    RegistryError,
)
from serving.http.common import MintJSONResponse, entry_json
from serving.worker.readiness import RevisionNotReady

RETRY_AFTER_S = 1
ECHO_LIMIT = 200
"""Longest stretch of a value (adapter id, model name, field value) an error message echoes;
the rest becomes an ellipsis. A value is what the caller sent: it may be any length."""
MESSAGE_LIMIT = 4 * ECHO_LIMIT
"""Longest error message."""
LISTED_FIELDS = 5
"""Most refused fields one validation error names."""
_LONG_RUN = re.compile(rf"\S{{{ECHO_LIMIT + 1},}}")
_RETRY = {"Retry-After": str(RETRY_AFTER_S)}


def retry_after(seconds: float | None) -> dict[str, str]:
    """The headers that tell a client when to try again: `Retry-After` in whole seconds (HTTP's
    only form) and `Retry-After-Ms` in milliseconds (as OpenAI's API sends it, and its clients
    honour it first), so a wait shorter than a second is not rounded up to one."""
    if seconds is None:
        return dict(_RETRY)
    whole = max(1, math.ceil(seconds))
    return {"Retry-After": str(whole), "Retry-After-Ms": str(round(seconds * 1000))}


def clip(text: str, limit: int = ECHO_LIMIT) -> str:
    """`text`, cut to `limit` characters and an ellipsis if longer."""
    return text if len(text) <= limit else text[:limit] + "…"


def shorten(message: str) -> str:
    """`message` with each value it echoes cut short: every stretch without a space longer than
    ECHO_LIMIT (a 10,000-character adapter id), and the whole message past MESSAGE_LIMIT."""
    return clip(_LONG_RUN.sub(lambda run: clip(run[0]), message), MESSAGE_LIMIT)


class BodyTooLarge(HTTPException):
    """A request body over the worker's size limit (413). An HTTPException, so that FastAPI
    passes it on as it is when reading the body raises it, instead of calling the body
    malformed."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            f"the request body is larger than this worker's limit of {limit} bytes "
            "(max_request_bytes); send a shorter prompt or fewer messages",
        )


@dataclass(frozen=True)
class ErrorResponse:
    """An error as the API responds with it: a status, a body in TGI's shape (`error`, `error_type`,
    plus the names that explain it) and headers. A stream sends the body as its last event."""

    status: int
    error_type: str
    message: str
    names: Mapping[str, object] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)

    @property
    def body(self) -> dict[str, object]:
        return {"error": shorten(self.message), "error_type": self.error_type, **self.names}

    def to_response(self) -> MintJSONResponse:
        return MintJSONResponse(self.body, status_code=self.status, headers=dict(self.headers))


def error_response(e: Exception, request: Request | None = None) -> ErrorResponse:
    """The one table from what went wrong to the response, for every endpoint and
    stream. `request` names the route in responses about routing."""
    route = f"{request.method} {request.url.path}" if request else "this request"
    match e:
        case AuthenticationError():
            return ErrorResponse(
                401, "unauthenticated", str(e), headers={"WWW-Authenticate": "Bearer"}
            )
        case AccessDeniedError():
            return ErrorResponse(403, "forbidden", str(e))
        case NotFoundError():
            return ErrorResponse(404, "not_found", str(e))
        case BaseMismatchError():
            return ErrorResponse(409, "base_mismatch", str(e))
        case RevisionNotReady():
            return ErrorResponse(
                503, "not_ready", str(e), entry_json(e.entry), retry_after(e.retry_after_s)
            )
        case ConfigurationError():
            return ErrorResponse(422, "validation", str(e))
        case RegistryError():
            return ErrorResponse(503, "registry_unavailable", str(e), headers=_RETRY)
        case EngineUnavailableError():
            return ErrorResponse(503, "engine_unavailable", str(e), headers=_RETRY)
        case MintError():
            return ErrorResponse(503, _error_type(e), str(e))
        case RequestValidationError():
            return ErrorResponse(422, "validation", _refused_fields(e.errors()))
        case BodyTooLarge():
            return ErrorResponse(413, "body_too_large", e.detail)
        case HTTPException(status_code=400):
            # FastAPI answers 400 to a body it cannot decode (not UTF-8), and 422 to one that
            # is not JSON; to a client both are malformed, which the API answers 422.
            return ErrorResponse(422, "validation", f"the body is not JSON in UTF-8: {e.__cause__}")
        case HTTPException(status_code=405):
            allowed = (e.headers or {}).get("Allow", "")
            message = f"{route}: this endpoint takes {allowed}"
            return ErrorResponse(405, "method_not_allowed", message, headers=e.headers or {})
        case HTTPException():
            status = HTTPStatus(e.status_code)
            error_type = status.phrase.lower().replace(" ", "_")
            message = f"{route}: no such endpoint" if status is HTTPStatus.NOT_FOUND else e.detail
            return ErrorResponse(e.status_code, error_type, message, headers=e.headers or {})
        case _:
            return ErrorResponse(
                500, "internal", f"{route} failed; the worker's log has the details"
            )


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
