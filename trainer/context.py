"""What every route of the trainer's API depends on: who calls (`Principal`, from the API key,
each call counted for `/health`), the trainer (`CurrentTrainer`) and its futures
(`CurrentFutures`), and `future`, which answers a request with a future that its work finishes
or fails.

`create_app` keeps the trainer, its futures, the API keys and the body limit in the app's
state; routes get them through these dependencies, so each router is a module-level
`APIRouter`.
"""

from collections.abc import Callable
from typing import Annotated

from fastapi import Depends, Request

from mint_core.access import ANONYMOUS
from mint_core.errors import AuthenticationError
from trainer.errors import QueueFull, failure
from trainer.futures import Futures
from trainer.service import Trainer


def principal(request: Request) -> str:
    """The principal the `X-API-Key` header names (anyone is `anonymous` without keys); the
    call is counted under its route's name."""
    route = request.scope.get("route")
    calls = call_counts(request)
    name = getattr(route, "name", "")
    calls[name] = calls.get(name, 0) + 1
    keys = request.app.state.api_keys
    if not keys:
        return ANONYMOUS
    key = request.headers.get("x-api-key")
    if key is None or key not in keys:
        raise AuthenticationError("the X-API-Key is not known to this trainer")
    return keys[key]  # type: ignore[no-any-return]


def current_trainer(request: Request) -> Trainer:
    return request.app.state.trainer  # type: ignore[no-any-return]


def current_futures(request: Request) -> Futures:
    return request.app.state.futures  # type: ignore[no-any-return]


def call_counts(request: Request) -> dict[str, int]:
    """Requests per API route since start (`/health` shows them)."""
    return request.app.state.calls  # type: ignore[no-any-return]


def max_request_bytes(request: Request) -> int:
    """The most bytes a request's body may hold, decompressed too."""
    return request.app.state.max_request_bytes  # type: ignore[no-any-return]


Principal = Annotated[str, Depends(principal)]
CurrentTrainer = Annotated[Trainer, Depends(current_trainer)]
CurrentFutures = Annotated[Futures, Depends(current_futures)]
CallCounts = Annotated[dict[str, int], Depends(call_counts)]
MaxRequestBytes = Annotated[int, Depends(max_request_bytes)]


def future(futures: Futures, who: str, work: Callable[[str], None]) -> dict[str, object]:
    """A new future; `work(request_id)` queues what finishes it, or fails it at once
    (`trainer.errors.failure`); a full queue is the request's answer (429), not its future's."""
    request_id = futures.create(who)
    try:
        work(request_id)
    except QueueFull:
        raise
    except Exception as e:
        futures.finish(request_id, failure(e, f"request {request_id}"))
    return {"request_id": request_id}
