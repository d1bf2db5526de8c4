"""The trainer's answers to errors: MinT's one table (`serving.http.errors.error_response`,
the worker's and the gateway's), the two cases only the trainer has, and how a future fails
(`failure`: the SDK's `{"error", "category"}`).

- A model's queue full (`QueueFull`) is a 429 with Retry-After: the SDK waits and sends the
  request again, as it should.
- A JSON body nested deeper than the parser goes (it raises RecursionError) is a 422 that
  says so, not "not JSON".
- A MinT error the table does not name is the request's (400), not a 503 to try again:
  only a registry or an engine that cannot answer now is that.

What the SDK does with an answer decides the rest: it resends a 5xx (and 408, 409, 429)
without limit, and gives up on any other 4xx. So a bad request is a 4xx (422 with the field
named, from the table), and a 500, a bug a resend cannot mend, carries `x-should-retry:
false`, which the SDK obeys; its details go to the trainer's log with the traceback.
"""

import logging

from fastapi import Request
from starlette.exceptions import HTTPException

from mint_core.errors import AccessDeniedError, MintError, RegistryError, ServiceError
from serving.http.errors import ErrorResponse, error_response, retry_after
from trainer.futures import Category, Failure

log = logging.getLogger(__name__)


class QueueFull(MintError):
    """A model has `trainer_queue` requests waiting: the client should send this one later."""


def trainer_error(e: Exception, request: Request | None = None) -> ErrorResponse:
    """The response to `e`: MinT's table, with the trainer's own cases first."""
    match e:
        case QueueFull():
            return ErrorResponse(429, "queue_full", str(e), headers=retry_after(1.0))
        case HTTPException(status_code=400, __cause__=RecursionError()):
            return ErrorResponse(
                422,
                "validation",
                "the body is nested too deeply to parse; the Tinker API's bodies nest a few "
                "levels (send the SDK's request)",
            )
    answer = error_response(e, request)
    if answer.status == 503 and not isinstance(e, RegistryError | ServiceError):
        # The table's 503 for a MinT error it does not name is a worker's "try later". Here
        # such an error (a checkpoint that fails its digest, a refused transition) is the
        # request's, and the SDK would resend a 503 without limit.
        return ErrorResponse(400, answer.error_type, answer.message)
    if answer.status >= 500 and answer.error_type == "internal":
        return ErrorResponse(
            answer.status, answer.error_type, answer.message, headers={"x-should-retry": "false"}
        )
    return answer


def failure(e: Exception, doing: str, mint_errors: Category = Category.USER) -> Failure:
    """How a future fails with `e`, raised while `doing` (`"registering <path>"`): the table's
    half for work that answers through a future.

    - A MinT error is `mint_errors`'s fault. The request's (`user`, the default) where its own
      values raised it: said as it is, since it names the value. MinT's (`server`) for the work
      MinT does after it took the request (registering its weights, sampling): said with what
      failed. A refused access is the request's either way: it named another tenant's adapter.
    - Anything else is a bug (`server`): its traceback goes to the log, which the message
      points at.
    """
    match e:
        case MintError() if mint_errors is Category.USER:
            return Failure(str(e), Category.USER)
        case AccessDeniedError():
            return Failure(f"{doing} failed: {e}", Category.USER)
        case MintError():
            return Failure(f"{doing} failed: {e}", Category.SERVER)
    log.error("%s failed", doing, exc_info=e)
    return Failure(
        f"{doing} failed ({type(e).__name__}); the trainer's log has the details", Category.SERVER
    )
