"""Forwarding one request to the workers that may take it, in order, and passing the answer
on (whole, or as an event stream); a worker that fails while it holds a request answers 502."""

import logging
from collections.abc import AsyncIterator

import aiohttp
import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from mint_core.errors import UnavailableError
from serving.gateway.fleet import WorkerView
from serving.gateway.links import CONNECT_TIMEOUT_S, Link, Links
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
    links: Links,
    request: Request,
    body: bytes,
    model: str | None,
    workers: list[WorkerView],
    revision: str | None,
) -> Response:
    """`request` (its `body` read) from the first of `workers` that takes it, for `model`. A
    worker that refuses the connection or does not take it in time never saw the request: the
    next one gets it; so does the next when the connection closed or reset before any byte of
    an answer came (`never_answered`). Once a worker has begun its answer, the request is its
    (a generation is not replayed: it may have run, and a stream may have started)."""
    headers = {"content-type": "application/json"}
    if authorization := request.headers.get("authorization"):
        headers["authorization"] = authorization
    last_busy: Response | None = None
    for worker in workers:
        was_ready = revision is None or revision in worker.ready
        link = links.of(worker.url)
        worker.in_flight += 1
        try:
            url = worker.url + request.url.path
            answer = await link.session.post(url, data=body, headers=headers)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
            worker.in_flight -= 1
            worker.down(f"did not take a connection: {e}")  # it never saw the request: next one
            continue
        except (aiohttp.ClientError, TimeoutError) as e:
            worker.in_flight -= 1
            if never_answered(e, link):
                worker.down(f"closed the connection before answering: {type(e).__name__}: {e}")
                continue
            return _failed(worker, link, e)
        link.opened(answer)
        if answer.content_type == "text/event-stream" and answer.status != 503:
            return _streamed(answer, worker, link)
        try:
            content = await answer.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            return _failed(worker, link, e)
        finally:
            worker.in_flight -= 1
            link.closed(answer)
        if answer.status != 503:
            return whole_answer(answer, worker, content)
        last_busy = whole_answer(answer, worker, content)
        if not was_ready and _error_type(content) == "not_ready":
            return last_busy  # its placement: it admits the revision by demand
    if last_busy is not None:
        return last_busy
    log.warning("no worker took %s: %s", model, "; ".join(f"{w.url}: {w.problem}" for w in workers))
    raise UnavailableError(
        f"every worker for {model or 'the base'} refused the connection or did not take it in "
        f"{CONNECT_TIMEOUT_S:g} s; send the request again shortly"
    )


def never_answered(error: BaseException, link: Link) -> bool:
    """Whether a request that failed with `error` before its answer's head came goes to the
    next worker: its connection was closed or reset with nothing sent back. That is a relay or
    load balancer in front of a worker that has just closed its listener (it accepts, finds
    nothing behind, and closes), or a pooled connection the worker closed as it was reused:
    the request never reached a worker that could run it. Not a timeout, and not a link the
    gateway cut (a worker cut off, that may be running it: `serving.gateway.links`)."""
    if link.cut is not None:
        return False
    return isinstance(error, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError)


def not_ready_revision(answer: Response) -> str | None:
    """The revision a worker's "not ready" answer is about (as its worker resolved the name);
    None for any other answer (a stream has no body here)."""
    if answer.status_code != 503 or not isinstance(answer.body, bytes):
        return None
    body = _error_body(answer.body)
    revision = body.get("id") if body.get("error_type") == "not_ready" else None
    return revision if isinstance(revision, str) else None


def _error_type(content: bytes) -> str | None:
    """The `error_type` of a worker's error answer; None if it has none."""
    error_type = _error_body(content).get("error_type")
    return error_type if isinstance(error_type, str) else None


def _error_body(content: bytes) -> dict[str, object]:
    """A worker's error answer as its fields; empty if it is not a JSON object."""
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        return {}
    return body if isinstance(body, dict) else {}


def json_answer(payload: object) -> Response:
    return Response(orjson.dumps(payload), media_type="application/json")


def _kept(answer: aiohttp.ClientResponse, worker: WorkerView) -> dict[str, str]:
    kept = {name: answer.headers[name] for name in _PASSED_ON if name in answer.headers}
    return kept | {WORKER_HEADER: worker.url}


def whole_answer(answer: aiohttp.ClientResponse, worker: WorkerView, content: bytes) -> Response:
    return Response(content, status_code=answer.status, headers=_kept(answer, worker))


def _failure(
    worker: WorkerView, link: Link, error: BaseException, when: str = "while it had this request"
) -> ErrorResponse:
    """What a client is told of a request a worker took and then failed: it died or cut the
    reply (`worker_failed`), or it stopped answering and the gateway cut its link
    (`worker_unreachable`). What failed goes to the gateway's log."""
    if link.cut is not None:
        log.warning("%s: a request it had was ended, %s", worker.url, link.cut)
        message = (
            f"worker {worker.url} stopped answering {when} ({link.cut}); the request was not "
            "sent to another worker, as it may have run: send it again"
        )
        return ErrorResponse(502, "worker_unreachable", message)
    log.warning("%s failed %s: %s: %s", worker.url, when, type(error).__name__, error)
    message = (
        f"worker {worker.url} failed {when}; the request was not retried, as it may have run: "
        "send it again"
    )
    return ErrorResponse(502, "worker_failed", message)


def _failed(worker: WorkerView, link: Link, error: BaseException) -> Response:
    answer = _failure(worker, link, error)
    headers = {WORKER_HEADER: worker.url}
    return Response(orjson.dumps(answer.body), 502, headers, media_type="application/json")


def _streamed(answer: aiohttp.ClientResponse, worker: WorkerView, link: Link) -> StreamingResponse:
    """A worker's event stream, passed on as it comes; a worker that fails mid-stream ends it
    with an error event."""

    async def events() -> AsyncIterator[bytes]:
        try:
            async for chunk in answer.content.iter_any():
                link.heard()
                yield chunk
        except (aiohttp.ClientError, TimeoutError) as e:
            yield sse(_failure(worker, link, e, "mid-stream").body).encode()
        finally:
            worker.in_flight -= 1
            link.closed(answer)

    return StreamingResponse(events(), status_code=answer.status, headers=_kept(answer, worker))
