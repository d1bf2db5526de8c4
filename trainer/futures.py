"""Futures: every call that does work answers a request id at once; the SDK polls for the
result (`retrieve_future`), which this table answers when it is ready or after a long poll.

A result is protobuf bytes (forward/backward, sampling) or a JSON object; a failure carries a
message and a category (`user`: the request was bad; `server`: MinT failed). Finished
entries are kept for `KEEP_S` after they finish, so a poll repeated after a lost reply still
finds them.
"""

import asyncio
import threading
import time
import uuid
from dataclasses import dataclass
from enum import StrEnum

from mint_core.errors import NotFoundError

KEEP_S = 600.0
LONG_POLL_S = 20.0
"""How long one `retrieve_future` waits for a result before answering `try_again` (the SDK's
own timeout for it is 45 s, and it polls again at once)."""


class Category(StrEnum):
    """The SDK's `RequestErrorCategory` values."""

    USER = "user"
    SERVER = "server"


@dataclass(frozen=True)
class Failure:
    message: str
    category: Category


Outcome = bytes | dict[str, object] | Failure


class _Entry:
    def __init__(self, loop: asyncio.AbstractEventLoop, principal: str) -> None:
        self.loop = loop
        self.principal = principal
        self.done: asyncio.Future[Outcome] = loop.create_future()
        self.finished_at: float | None = None


class Futures:
    """The table of futures, shared by the HTTP handlers (one event loop) and the threads that
    finish them."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()

    def create(self, principal: str) -> str:
        request_id = uuid.uuid4().hex
        with self._lock:
            self._purge()
            self._entries[request_id] = _Entry(self.loop, principal)
        return request_id

    def finish(self, request_id: str, outcome: Outcome) -> None:
        """Set the outcome of `request_id`, from any thread; the first outcome wins."""
        with self._lock:
            entry = self._entries.get(request_id)
        if entry is None:
            return

        def settle() -> None:
            if not entry.done.done():
                entry.done.set_result(outcome)
                entry.finished_at = time.monotonic()

        self.loop.call_soon_threadsafe(settle)

    def fail(self, request_id: str, message: str, category: Category = Category.USER) -> None:
        self.finish(request_id, Failure(message, category))

    async def wait(
        self, request_id: str, principal: str, timeout_s: float = LONG_POLL_S
    ) -> Outcome | None:
        """The outcome of `request_id`, or None if it is not ready within `timeout_s`.
        NotFoundError for an id this table does not know (or another principal's)."""
        with self._lock:
            entry = self._entries.get(request_id)
        if entry is None or entry.principal != principal:
            raise NotFoundError(f"no request {request_id!r} is known to this trainer")
        try:
            return await asyncio.wait_for(asyncio.shield(entry.done), timeout_s)
        except TimeoutError:
            return None

    def pending(self) -> int:
        with self._lock:
            return sum(not e.done.done() for e in self._entries.values())

    def _purge(self) -> None:
        now = time.monotonic()
        for request_id in [
            rid
            for rid, e in self._entries.items()
            if e.finished_at is not None and now - e.finished_at > KEEP_S
        ]:
            del self._entries[request_id]
