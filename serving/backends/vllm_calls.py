"""The vLLM backend's generations as coroutines on one event loop of their own, over one pool of
kept-alive HTTP connections (`serving.backends.vllm` drives them).

A generation waits on vLLM almost all its life: a thread each (and httpx's per-request cost)
took CPU from vLLM on the same cores for nothing. Here every generation is a task on one loop
thread; `MAX_GENERATIONS` of them talk to vLLM at once, the rest wait as the queue."""

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import Future
from typing import Any

import aiohttp
import orjson

from mint_core.errors import (
    ConfigurationError,
    EngineUnavailableError,
    MintError,
    NotReadyError,
    ServiceError,
)

log = logging.getLogger(__name__)

__all__ = ["MAX_GENERATIONS", "Calls", "choice_of", "error_message", "events", "generation_error"]

MAX_GENERATIONS = 256
"""Generations sent to vLLM at once: far more than vLLM batches (`--max-num-seqs`), so vLLM's
own queue stays fed; more wait here and count as the queue."""
CONNECT_TIMEOUT_S = 5.0
CLOSE_TIMEOUT_S = 10.0
JSON_HEADERS = {"Content-Type": "application/json"}


class Calls:
    """An event loop on a daemon thread, with an aiohttp session to vLLM: `start` runs a
    coroutine there from any thread."""

    def __init__(self, base_url: str, api_key: str) -> None:
        self.base_url = base_url
        self._headers = {"Authorization": f"Bearer {api_key}"}
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._session: aiohttp.ClientSession | None = None
        self._slots: asyncio.Semaphore | None = None
        self._closing = False
        self._tasks: set[asyncio.Task[None]] = set()
        """Generations under way or waiting (the loop keeps only weak references to tasks)."""
        self.waiting = 0
        """Generations waiting for one of `MAX_GENERATIONS` (only the loop thread writes it)."""
        self._thread = threading.Thread(target=self._serve, name="vllm-calls", daemon=True)
        self._thread.start()
        self._ready.wait()

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._open())
        self._ready.set()
        self._loop.run_forever()

    async def _open(self) -> None:
        # A long generation is not a hang: no total timeout, only on connecting.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
        self._session = aiohttp.ClientSession(
            self.base_url,
            headers=self._headers,
            connector=aiohttp.TCPConnector(limit=MAX_GENERATIONS),
            timeout=timeout,
            auto_decompress=False,
        )
        self._slots = asyncio.Semaphore(MAX_GENERATIONS)

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "opened before the loop runs"
        return self._session

    def start(
        self, work: Callable[[], Coroutine[Any, Any, None]], cancelled: Callable[[], None]
    ) -> Future[None]:
        """Run `work()` on the loop once one of `MAX_GENERATIONS` is free; `cancelled()` if
        the loop closes before it starts (`work` hears of a close itself once started)."""
        if self._closing:
            cancelled()
            return Future()

        async def run() -> None:
            assert self._slots is not None
            task = asyncio.current_task()
            assert task is not None
            self._tasks.add(task)
            self.waiting += 1
            try:
                try:
                    await self._slots.acquire()
                finally:
                    self.waiting -= 1
            except asyncio.CancelledError:
                self._tasks.discard(task)
                cancelled()
                raise
            try:
                await work()
            finally:
                self._slots.release()
                self._tasks.discard(task)

        return asyncio.run_coroutine_threadsafe(run(), self._loop)

    async def post(self, path: str, payload: dict[str, object]) -> aiohttp.ClientResponse:
        """POST `payload` as JSON; the caller reads (or closes) the response."""
        return await self.session.post(path, data=orjson.dumps(payload), headers=JSON_HEADERS)

    def close(self) -> None:
        """Cancel what still runs or waits (each fails its request: see `VllmBackend`), close
        the connections, stop the loop. Idempotent."""
        if self._closing:
            return
        self._closing = True

        async def shut() -> None:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self.session.close()

        try:
            asyncio.run_coroutine_threadsafe(shut(), self._loop).result(CLOSE_TIMEOUT_S)
        except Exception:  # the worker's close must go on to stop vLLM whatever happens here
            log.exception("closing the generations to vLLM failed")
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=CLOSE_TIMEOUT_S)


async def events(lines: AsyncIterator[bytes]) -> AsyncIterator[dict]:
    """The JSON objects of a server-sent event stream, up to `[DONE]`."""
    async for line in lines:
        if not line.startswith(b"data:"):
            continue
        data = line[len(b"data:") :].strip()
        if data == b"[DONE]":
            return
        yield orjson.loads(data)


def choice_of(key: str, answer: dict) -> dict:
    """The one choice of a completion answer or stream chunk; an error event raises."""
    if "error" in answer:
        raise ServiceError(f"vLLM failed {key}: {answer['error']}")
    return answer["choices"][0]


def error_message(status: int, body: bytes) -> str:
    """vLLM's message in an error answer (`{"error": {"message": ...}}`), else its body."""
    try:
        error = orjson.loads(body)["error"]
        return str(error["message"] if isinstance(error, dict) else error)
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace") or f"HTTP {status}"


def generation_error(key: str, status: int, body: bytes) -> MintError:
    """MinT's error for vLLM's answer `status` with `body` to a generation for `key`."""
    message = error_message(status, body)
    if status == 404:
        return NotReadyError(f"{key} is not loaded in vLLM: {message}")
    if status == 503:  # vLLM's answer while its engine is dead
        return EngineUnavailableError(f"vLLM cannot generate for {key}: {message}")
    if status in (400, 422):
        return ConfigurationError(f"vLLM refused the request for {key}: {message}")
    return ServiceError(f"vLLM answered {status} for {key}: {message}")
