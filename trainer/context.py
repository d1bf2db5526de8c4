"""What every route of the trainer's API depends on: who calls (`Caller`, from the API key, each
call counted for `/health`), the trainer (`Service`) and its futures (`Pending`), and `future`,
which answers a request with a future that its work finishes or fails.

`create_app` keeps the trainer, its futures and the API keys in the app's state; routes get
them through these dependencies, so each router is a module-level `APIRouter`.
"""

import logging
from collections.abc import Callable
from typing import Annotated

from fastapi import Depends, Request

from mint_core.access import ANONYMOUS
from mint_core.errors import AuthenticationError, MintError
from trainer.errors import QueueFull
from trainer.futures import Category, Futures
from trainer.service import Trainer

log = logging.getLogger(__name__)


def caller(request: Request) -> str:
    """The principal the `X-API-Key` header names (anyone is `anonymous` without keys); the
    call is counted under its route's name."""
    route = request.scope.get("route")
    calls: dict[str, int] = request.app.state.calls
    name = getattr(route, "name", "")
    calls[name] = calls.get(name, 0) + 1
    keys = request.app.state.api_keys
    if not keys:
        return ANONYMOUS
    key = request.headers.get("x-api-key")
    if key is None or key not in keys:
        raise AuthenticationError("the X-API-Key is not known to this trainer")
    return keys[key]  # type: ignore[no-any-return]


def service(request: Request) -> Trainer:
    return request.app.state.trainer  # type: ignore[no-any-return]


def pending(request: Request) -> Futures:
    return request.app.state.futures  # type: ignore[no-any-return]


Caller = Annotated[str, Depends(caller)]
Service = Annotated[Trainer, Depends(service)]
Pending = Annotated[Futures, Depends(pending)]


def future(futures: Futures, who: str, work: Callable[[str], None]) -> dict[str, object]:
    """A new future; `work(request_id)` queues what finishes it, or fails it at once: with the
    error's message for a MinT error (the request's fault), with a pointer to the log for
    anything else (a bug, whose details stay in the log)."""
    request_id = futures.create(who)
    try:
        work(request_id)
    except QueueFull:
        raise
    except MintError as e:
        futures.fail(request_id, str(e))
    except Exception:
        log.exception("request %s failed", request_id)
        futures.fail(
            request_id,
            f"request {request_id} failed; the trainer's log has the details",
            Category.SERVER,
        )
    return {"request_id": request_id}
