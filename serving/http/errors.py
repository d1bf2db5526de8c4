"""The one table from what went wrong to the HTTP response, for the worker's API and the gateway.

Errors, whatever raised them (MinT, request validation, routing, a limit, a bug), have one
shape, TGI's: `error` and `error_type`, plus the names that explain them (`ErrorResponse`).
`error_response` is the table: unknown key 401, not allowed 403, unknown adapter or route 404,
a revision of another base 409, body over the size limit 413, malformed request 422, over a
quota 429 and not ready 503 with Retry-After, anything unexpected 500 (details in the log only,
of the service that the 500 names). Inside a stream, an error is one last event of that shape.

`install_error_handlers` puts the table in front of an app, the worker's and the gateway's
alike (and the trainer's, with its own cases first): every error, an unknown route (404) or
method (405) too, answers in that shape. A client that goes away mid-body, or sends too much,
is one line in the log, not a traceback: it is no failure of the service; an unexpected error
is logged with its traceback.

Values echoed in messages are cut short (`shorten`): a caller may send anything, of any
length, and an error message is no place to send it all back.
"""

import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from mint_core.errors import (
    ECHO_LIMIT,
    AccessDeniedError,
    AuthenticationError,
    BaseMismatchError,
    ConfigurationError,
    MintError,
    NotFoundError,
    RateLimitedError,
    RegistryError,
    UnavailableError,
    clip,
)
from serving.http.common import MintJSONResponse
from serving.http.wire import RevisionReadiness
from serving.worker.readiness import RevisionNotReady

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1
MESSAGE_LIMIT = 4 * ECHO_LIMIT
"""Longest error message."""
LISTED_FIELDS = 5
"""Most refused fields one validation error names."""
_LONG_RUN = re.compile(rf"\S{{{ECHO_LIMIT + 1},}}")
_RETRY = {"Retry-After": str(RETRY_AFTER_S)}
_NOTED = frozenset({"client_disconnected", "body_too_large"})
"""Error types logged as one line: the client's doing, not the service's, and one a client can
repeat a thousand times a second."""


def retry_after(seconds: float | None) -> dict[str, str]:
    """The headers that tell a client when to try again: `Retry-After` in whole seconds (HTTP's
    only form) and `Retry-After-Ms` in milliseconds (as OpenAI's API sends it, and its clients
    honour it first), so a wait shorter than a second is not rounded up to one."""
    if seconds is None:
        return dict(_RETRY)
    whole = max(1, math.ceil(seconds))
    return {"Retry-After": str(whole), "Retry-After-Ms": str(round(seconds * 1000))}


def shorten(message: str) -> str:
    """`message` with each value it echoes cut short: every stretch without a space longer than
    ECHO_LIMIT (a 10,000-character adapter id), and the whole message past MESSAGE_LIMIT. A
    lone surrogate a caller sent (JSON's `"\\ud800"`) is written as its escape: UTF-8 has no
    such character, and the answer must still be written."""
    short = clip(_LONG_RUN.sub(lambda run: clip(run[0]), message), MESSAGE_LIMIT)
    return short.encode("utf-8", "backslashreplace").decode("utf-8")


class BodyTooLarge(HTTPException):
    """A request body over the service's size limit (413). An HTTPException, so that FastAPI
    passes it on as it is when reading the body raises it, instead of calling the body
    malformed."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            f"the request body is larger than this service's limit of {limit} bytes "
            "(max_request_bytes); send less (a shorter prompt, fewer messages or datums)",
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


def install_error_handlers(
    app: Starlette, service: str, table: Callable[[Exception, Request], ErrorResponse] | None = None
) -> None:
    """Answer every error of `app` (a FastAPI or Starlette app) from `table` (MinT's,
    `error_response`, unless a service puts its own cases first), and name `service`
    ("worker", "gateway", "trainer") in its 500s: the log to read is that service's."""
    app.state.service = service
    answer_of = table or error_response

    def answer(request: Request, e: Exception) -> Response:
        answer = answer_of(e, request)
        if answer.error_type in _NOTED:
            log.warning("%s %s: %s", request.method, clip(request.url.path), answer.body["error"])
        return answer.to_response()

    # Exception goes to Starlette's outermost middleware, which passes the error on to the
    # server after this response: the server logs it with its traceback. The others are
    # answered where they are raised.
    for raised in (MintError, RequestValidationError, HTTPException, ClientDisconnect, Exception):
        app.add_exception_handler(raised, answer)


def error_response(e: Exception, request: Request | None = None) -> ErrorResponse:
    """The one table from what went wrong to the response, for every endpoint and
    stream. `request` names the route in responses about routing, and the service (see
    `install_error_handlers`) in a 500."""
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
                503,
                "not_ready",
                str(e),
                RevisionReadiness.of(e.entry).model_dump(mode="json"),
                retry_after(e.retry_after_s),
            )
        case RateLimitedError():
            names = {"limit": e.limit, "retry_after_s": round(e.retry_after_s, 3)}
            return ErrorResponse(429, "rate_limited", str(e), names, retry_after(e.retry_after_s))
        case ConfigurationError():
            return ErrorResponse(422, "validation", str(e))
        case RegistryError():
            return ErrorResponse(503, "registry_unavailable", str(e), headers=_RETRY)
        case UnavailableError():  # engine_unavailable, or unavailable: no worker took it
            return ErrorResponse(503, _error_type(e), str(e), headers=_RETRY)
        case MintError():
            return ErrorResponse(503, _error_type(e), str(e))
        case RequestValidationError():
            return ErrorResponse(422, "validation", _refused_fields(e.errors()))
        case BodyTooLarge():
            return ErrorResponse(413, "body_too_large", e.detail)
        case ClientDisconnect() | HTTPException(__cause__=ClientDisconnect()):
            # No one reads this answer; it is what the log says.
            return ErrorResponse(400, "client_disconnected", _GONE)
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
                500, "internal", f"{route} failed; {_log_of(request)} has the details"
            )


_GONE = (
    "the request's body stopped before its end: the client closed the connection, "
    "or stopped sending it"
)


def _log_of(request: Request | None) -> str:
    """Whose log has a 500's details: the service that answers it."""
    app = request.scope.get("app") if request is not None else None
    service = getattr(app.state, "service", None) if app is not None else None
    return f"the {service}'s log" if service else "this service's log"


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
