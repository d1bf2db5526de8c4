"""Serving an ASGI app over HTTP with bounded connections: `serve_http`, which the worker, the
gateway and the trainer run their apps with.

uvicorn bounds only the idle time after an answer: a connection that sends nothing, half a
request head or half a body is otherwise held for as long as the client likes. So the protocol
here (uvicorn's httptools protocol, pinned, with deadlines added) closes a connection whose
head does not arrive whole within `head_s`, answers 408 to a body that stops for `body_s`, 431
to a head past `HEAD_BYTES`, and 503 past `connections`; once a request has arrived whole
nothing is timed. The bounds, and what each answer says: the README, "Running the pieces"; the
defaults and why: `mint_core.connections.ConnectionBounds`.
"""

import asyncio
import contextlib
import logging
import resource
import sys
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from types import FrameType
from typing import Any, ClassVar, Literal

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.config import STARTUP_FAILURE
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from mint_core.connections import ConnectionBounds
from mint_core.exposure import TlsFiles
from serving.http.common import json_bytes
from serving.http.errors import ErrorResponse, retry_after

__all__ = [
    "BACKLOG",
    "HEAD_BYTES",
    "BoundedProtocol",
    "StoppingServer",
    "serve_http",
    "uvicorn_options",
]

log = logging.getLogger(__name__)

HEAD_BYTES = 16 << 10
"""Largest incomplete request head (request line and headers) a service holds (h11's default;
nginx's is 32 KiB): MinT's heads are a few hundred bytes."""
BACKLOG = 2048
"""Connections the kernel holds for a service before it accepts them (uvicorn's default; the
kernel caps it at net.core.somaxconn)."""
PLAIN = TlsFiles()
"""No certificate: plain HTTP."""
FD_RESERVE = 256
"""File descriptors a service needs besides its connections (model files, logs, its own
connections to MLflow and workers)."""


def serve_http(
    app: ASGIApp,
    host: str,
    port: int,
    bounds: ConnectionBounds,
    tls: TlsFiles = PLAIN,
    before_stop: Callable[[], None] | None = None,
    stop_timeout_s: float | None = None,
) -> None:
    """Serve `app` on `host`:`port` until stopped, its connections bounded by `bounds`; over
    HTTPS with `tls`'s certificate and key if it names them. `before_stop`: run (in a thread of
    its own) when SIGTERM or SIGINT first arrives, the listener still open; the server stops
    once it returns (a worker's drain: `serving.worker.leaving`). A second signal stops it at
    once. `stop_timeout_s`: how long, once it stops listening, it waits for the requests it
    still has before it cancels them (None: as long as they take)."""
    _raise_fd_limit(bounds.connections + FD_RESERVE)
    options = uvicorn_options(host, port, bounds, tls)
    config = uvicorn.Config(app, **options, timeout_graceful_shutdown=stop_timeout_s)
    server = StoppingServer(config, before_stop)
    # The signal that stopped it is raised again once it has stopped: ended here, as in
    # uvicorn.run.
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if not server.started:
        sys.exit(STARTUP_FAILURE)  # as uvicorn.run does: the port was taken, the app failed


def uvicorn_options(
    host: str, port: int, bounds: ConnectionBounds, tls: TlsFiles = PLAIN
) -> dict[str, Any]:
    """uvicorn.run's settings for `serve_http`."""
    options: dict[str, Any] = {
        "host": host,
        "port": port,
        "log_level": "warning",
        "http": bounded_protocol(bounds),
        "timeout_keep_alive": bounds.keep_alive_s,  # call_later takes floats
        "backlog": BACKLOG,
    }
    if tls.enabled:
        options |= {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key}
    return options


class StoppingServer(uvicorn.Server):
    """uvicorn's server, which runs `before_stop` (if any) before it stops listening."""

    def __init__(self, config: uvicorn.Config, before_stop: Callable[[], None] | None) -> None:
        super().__init__(config)
        self._before_stop = before_stop
        self._stopping: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._before_stop is None or self._stopping is not None:
            super().handle_exit(sig, frame)
            return
        self._captured_signals.append(sig)  # raised again once stopped, as uvicorn does
        self._stopping = threading.Thread(target=self._stop_after, name="before-stop", daemon=True)
        self._stopping.start()

    def _stop_after(self) -> None:
        assert self._before_stop is not None
        try:
            self._before_stop()
        except Exception:  # the server must stop whatever happened
            log.exception("getting ready to stop failed; stopping now")
        self.should_exit = True


def bounded_protocol(bounds: ConnectionBounds) -> type[HttpToolsProtocol]:
    """The protocol class uvicorn makes each connection's protocol from, with `bounds`."""
    return type("BoundedProtocol", (BoundedProtocol,), {"bounds": bounds})


class BoundedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline on reading each request and a bound on an
    incomplete head's size (see the module's docstring), and its concurrency limit answered in
    MinT's error shape."""

    bounds: ClassVar[ConnectionBounds] = ConnectionBounds()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.deadline: asyncio.TimerHandle | None = None
        self.reading: Literal["head", "body"] | None = None
        """What of a request is awaited (and timed): its head, its body, or nothing."""
        self.head_bytes = 0
        """Bytes received since the head's deadline was set, the head not yet whole."""
        # uvicorn's own limit answers 503 in plain text; `_admit` answers in MinT's shape.
        self.limit_concurrency = None
        self.app = self._admit

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.reading == "head":
            self.head_bytes += len(data)
        super().data_received(data)
        if self.reading == "head" and self.head_bytes > HEAD_BYTES:
            message = f"the request's head is over this service's limit of {HEAD_BYTES} bytes"
            self._refuse(431, "header_too_large", message, answer=True)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._await("body", self.bounds.body_s)  # ended at once by a request without one

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        self._await("body", self.bounds.body_s)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if self.cycle.response_complete and not self.pipeline:
            self._await_head()  # a body that went on past its answer ended: the next head
        else:
            self._disarm()  # a request arrived whole: its answer is not timed

    def on_response_complete(self) -> None:
        # A pipelined request, or a body still arriving, keeps the deadline it has.
        if self.reading is None and not self.pipeline:
            self._await_head()
        super().on_response_complete()

    def _await_head(self) -> None:
        self._await("head", self.bounds.head_s)
        self.head_bytes = 0

    def _await(self, reading: Literal["head", "body"], seconds: float) -> None:
        self._disarm()
        self.reading = reading
        self.deadline = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        self.reading = None
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _expired(self) -> None:
        self.deadline = None
        if self.transport.is_closing():
            return
        if self.reading == "head":
            self.transport.close()
            return
        if self.flow.read_paused or self.cycle.waiting_for_100_continue:
            # The service stopped reading (the app has not taken what came, or a pipelined
            # request waits) or has not yet said "100 Continue": the client is not stalling.
            self._await("body", self.bounds.body_s)
            return
        message = (
            f"the request's body stopped arriving for {self.bounds.body_s:g} s; send it whole, "
            "without pauses"
        )
        self._refuse(408, "request_timeout", message, answer=not self.cycle.response_started)

    def _refuse(self, status: int, error_type: str, message: str, answer: bool) -> None:
        """Answer `status` in MinT's error shape if `answer` (no answer to the request has
        begun), and close the connection."""
        self._disarm()
        cycle = self.cycle
        if answer:
            body = json_bytes(ErrorResponse(status, error_type, message).body)
            head = (
                f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
                "content-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
            )
            self.transport.write(head.encode() + body)
        if cycle is not None and not cycle.response_complete:
            # The app waiting for the body reads a disconnect; what it answers is dropped.
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()

    async def _admit(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app, unless the service is at its limit: then 503, and the connection closed."""
        limit = self.bounds.connections
        # This connection and this request's task are already counted.
        if len(self.connections) > limit or len(self.tasks) > limit:
            _warn_at_limit(limit)
            answer = ErrorResponse(
                503,
                "over_capacity",
                f"this service is serving its limit of {limit} connections; send the request "
                "again in a moment",
                headers={**retry_after(1.0), "Connection": "close"},
            )
            await answer.to_response()(scope, receive, send)
            return
        await self.config.loaded_app(scope, receive, send)


_warned_at = 0.0


def _warn_at_limit(limit: int) -> None:
    """One line a minute at most: a flood is thousands of 503s a second."""
    global _warned_at
    now = time.monotonic()
    if now - _warned_at >= 60:
        _warned_at = now
        log.warning("at its limit of %d connections: answering 503 (MINT_HTTP_BOUNDS)", limit)


def _raise_fd_limit(needed: int) -> None:
    """Let this process open `needed` files if its hard limit allows; say so if it does not:
    a service out of descriptors stops accepting connections, and says little."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    limit = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    if limit < needed:
        log.warning(
            "this process may open %d files (its hard limit), fewer than the %d its connection "
            "bound needs: lower MINT_HTTP_BOUNDS' connections, or raise the limit (ulimit -n)",
            limit,
            needed,
        )
