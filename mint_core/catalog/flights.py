"""Single flight: callers that ask the same question at the same time share one answer.

A worker restarted under a burst gets many requests for the same name before its first sync;
asked of MLflow once per request, they queue behind each other there (each authenticated
request costs the server a password check) until most time out. Asked once per name, they all
wait for that one read: its answer, or its error, is every caller's.
"""

import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Generic, TypeVar

T = TypeVar("T")


class Flights(Generic[T]):
    """Calls in flight by key: `run(key, call)` calls `call()` unless a call for `key` is in
    flight already, in which case it waits for that one and returns (or raises) what it did.
    Nothing is kept once a call ends: the next `run` of the key calls again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[Hashable, Future[T]] = {}

    def run(self, key: Hashable, call: Callable[[], T]) -> T:
        with self._lock:
            shared = self._running.get(key)
            if shared is None:
                mine: Future[T] = Future()
                self._running[key] = mine
        if shared is not None:
            return shared.result()
        try:
            answer = call()
        except BaseException as e:
            mine.set_exception(e)
            raise
        else:
            mine.set_result(answer)
            return answer
        finally:
            with self._lock:
                del self._running[key]
