"""The request body size limit, shared by the worker's API and the gateway: a body over the
limit is refused (413) before anything parses it, so no prompt costs an unbounded
tokenization."""

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.http.errors import BodyTooLarge, error_response

__all__ = ["MAX_REQUEST_BYTES", "BodyLimit"]

MAX_REQUEST_BYTES = 1 << 20
"""Largest request body a worker or gateway takes by default: far more than any context's
prompt."""


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes answers 413 before anything parses
    it. A declared Content-Length over the limit is refused at once; a body without one
    (chunked) is counted as it arrives, so leaving the length out does not get past it."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        # More digits than any limit has is over it, however many (int() refuses thousands).
        if declared.isdigit() and (len(declared) > 18 or int(declared) > self.limit):
            response = error_response(BodyTooLarge(self.limit)).to_response()
            await response(scope, receive, send)
            return
        await self.app(scope, _Counted(receive, self.limit), send)


class _Counted:
    """A `receive` that raises BodyTooLarge once the body it has passed on is over `limit`.
    FastAPI passes an HTTPException from reading the body on as it is: it answers 413."""

    def __init__(self, receive: Receive, limit: int) -> None:
        self.receive = receive
        self.limit = limit
        self.received = 0

    async def __call__(self) -> Message:
        message = await self.receive()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.limit:
                raise BodyTooLarge(self.limit)
        return message
