"""Forwarding one request to the workers that may take it, in order, and passing the answer
on (whole, or as an event stream); a worker that fails while it holds a request answers 502."""

import logging
from collections.abc import AsyncIterator

import aiohttp
import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from mint_core.errors import ServiceError
from serving.gateway.fleet import WorkerView
from serving.http.common import REQUEST_ID_HEADER, REVISION_HEADER, sse
from serving.http.errors import ErrorResponse

log = logging.getLogger(__name__)

WORKER_HEADER = "X-Mint-Worker"
"""Names the worker that answered, for operators and tests."""
_PASSED_ON = (
    "content-type",
    "retry-after",
    "retry-after-ms",
    "www-authenticate",
    REVISION_HEADER.lower(),
    REQUEST_ID_HEADER.lower(),
)
"""Response headers a worker's answer keeps through the gateway."""


async def forward_to(
    http: aiohttp.ClientSession,
    request: Request,
    body: bytes,
    model: str | None,
    workers: list[WorkerView],
    revision: str | None,
) -> Response:
    """`request` (its `body` read) from the first of `workers` that takes it, for `model`."""
    headers = {"content-type": "application/json"}
    if authorization := request.headers.get("authorization"):
        headers["authorization"] = authorization
    last_busy: Response | None = None
    for worker in workers:
        was_ready = revision is None or revision in worker.ready
        worker.in_flight += 1
        try:
            answer = await http.post(worker.url + request.url.path, data=body, headers=headers)
        except aiohttp.ClientConnectorError as e:
            worker.in_flight -= 1
            worker.down(f"refused a connection: {e}")  # it never saw the request: next one
            continue
        except (aiohttp.ClientError, TimeoutError) as e:
            worker.in_flight -= 1
            return _failed(worker, e)
        if answer.status == 503:
            content = await answer.read()
            last_busy = whole_answer(answer, worker, content)
            worker.in_flight -= 1
            answer.release()
            if not was_ready and _error_type(content) == "not_ready":
                return last_busy  # its placement: it admits the revision by demand
            continue
        if answer.content_type == "text/event-stream":
            return _streamed(answer, worker)
        try:
            content = await answer.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            return _failed(worker, e)
        finally:
            worker.in_flight -= 1
            answer.release()
        return whole_answer(answer, worker, content)
    if last_busy is not None:
        return last_busy
    log.warning("no worker took %s: %s", model, "; ".join(f"{w.url}: {w.problem}" for w in workers))
    raise ServiceError(
        f"every worker for {model or 'the base'} refused the connection; send the request "
        "again shortly"
    )


def _error_type(content: bytes) -> str | None:
    """The `error_type` of a worker's error answer; None if it has none."""
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        return None
    return body.get("error_type") if isinstance(body, dict) else None


def json_answer(payload: object) -> Response:
    return Response(orjson.dumps(payload), media_type="application/json")


def _kept(answer: aiohttp.ClientResponse, worker: WorkerView) -> dict[str, str]:
    kept = {name: answer.headers[name] for name in _PASSED_ON if name in answer.headers}
    return kept | {WORKER_HEADER: worker.url}


def whole_answer(answer: aiohttp.ClientResponse, worker: WorkerView, content: bytes) -> Response:
    return Response(content, status_code=answer.status, headers=_kept(answer, worker))


def _failed(worker: WorkerView, error: BaseException) -> Response:
    """The answer for a request a worker took and then failed (it died, or cut the reply); what
    failed goes to the gateway's log."""
    log.warning("%s failed while it had a request: %s: %s", worker.url, type(error).__name__, error)
    message = (
        f"worker {worker.url} failed while it had this request; the request was not retried, "
        "as it may have run: send it again"
    )
    answer = ErrorResponse(502, "worker_failed", message)
    return Response(orjson.dumps(answer.body), status_code=502, headers={WORKER_HEADER: worker.url})


def _streamed(answer: aiohttp.ClientResponse, worker: WorkerView) -> StreamingResponse:
    """A worker's event stream, passed on as it comes; a worker that fails mid-stream ends it
    with an error event."""

    async def events() -> AsyncIterator[bytes]:
        try:
            async for chunk in answer.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, TimeoutError) as e:
            log.warning("%s failed mid-stream: %s: %s", worker.url, type(e).__name__, e)
            message = f"worker {worker.url} failed mid-stream; send the request again"
            yield sse(ErrorResponse(502, "worker_failed", message).body).encode()
        finally:
            worker.in_flight -= 1
            answer.release()

    return StreamingResponse(events(), status_code=answer.status, headers=_kept(answer, worker))
