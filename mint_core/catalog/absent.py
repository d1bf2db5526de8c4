"""Adapters the registry said it does not have, remembered briefly.

A request for an adapter that does not exist is a question the catalog cannot answer from its
index, so it asks MLflow; asked again for every such request, unknown names (a typo in a
client's loop, a scanner trying names) keep MLflow busy answering "no" and slow every other
caller of it. So "not found" about an adapter the catalog does not know is kept for
`ABSENT_TTL_S` and answered from memory meanwhile; a sync that sees the adapter appear forgets
what was kept about it, so a name registered after its 404 is served from that sync on.

Bounded (`ABSENT_NAMES`): a caller that sends a million distinct names costs at most that many
entries; the oldest go first.
"""

import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Iterable

from mint_core.errors import NotFoundError

ABSENT_TTL_S = 30.0
"""How long a registry's "not found" is kept: long enough that a burst of requests for an
unknown name asks MLflow once, short enough that a name registered meanwhile is found soon
even before a sync sees it."""
ABSENT_NAMES = 10_000
"""Most names kept; about 300 bytes each."""


class Absent:
    """`NotFoundError`s by the name asked (a RevisionRef, a RevisionId or an adapter's name),
    each kept for `ttl_s` seconds or until its adapter is forgotten. Thread-safe."""

    def __init__(self, ttl_s: float = ABSENT_TTL_S, limit: int = ABSENT_NAMES) -> None:
        self.ttl_s = ttl_s
        self.limit = limit
        self._lock = threading.Lock()
        self._entries: OrderedDict[Hashable, tuple[float, str, str]] = OrderedDict()
        """Name -> (when it expires, its adapter, the message of the NotFoundError the
        registry's answer made)."""
        self.answered = 0
        """How many times a kept "not found" was answered instead of asking the registry."""

    def check(self, name: Hashable) -> None:
        """Raise the NotFoundError kept for `name`, if any still holds."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                return
            expires, _, message = entry
            if time.monotonic() >= expires:
                del self._entries[name]
                return
            self.answered += 1
        # A new exception each time: one raised in several threads at once would share (and
        # grow) one traceback.
        raise NotFoundError(message)

    def keep(self, name: Hashable, adapter: str, error: NotFoundError) -> None:
        with self._lock:
            self._entries.pop(name, None)
            self._entries[name] = (time.monotonic() + self.ttl_s, adapter, str(error))
            while len(self._entries) > self.limit:
                self._entries.popitem(last=False)

    def forget(self, adapters: Iterable[str]) -> None:
        """Drop what is kept about `adapters` (a sync saw them appear or change)."""
        changed = set(adapters)
        if not changed:
            return
        with self._lock:
            for name in [n for n, (_, a, _) in self._entries.items() if a in changed]:
                del self._entries[name]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
