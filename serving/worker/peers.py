"""The other workers of this worker's base, as this worker sees them: who is live (for
placement), and asking the placed worker to admit a revision a request here wanted.

A worker's peers are the URLs of MINT_WORKER_URLS other than its own (MINT_WORKER_URL); each
sync asks their `/health` (in parallel, with a short timeout): a peer that answers with this
worker's base digest is live. A worker whose own URL is not in that list is not part of the
fleet it names: it has no peers, and every revision is placed on it. A peer that stops
answering stays live for `MISSES_TO_LEAVE` checks in a row, so that a peer busy for a moment
does not move its revisions back and forth.
"""

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from mint_core.errors import MintError
from mint_core.planning.placement import place
from mint_core.revisions import RevisionId
from serving.http.client import WorkerClient
from serving.http.wire import ASK_INTERVAL_S

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 1.0
MISSES_TO_LEAVE = 3
"""Health checks in a row a live peer may miss before it counts as gone."""


class Peers:
    """The live workers of one base, this one included; thread-safe."""

    def __init__(self, me: str, urls: Sequence[str], base_digest: str, api_key: str = "") -> None:
        self.me = me.rstrip("/")
        """This worker, named as MINT_WORKER_URLS names it."""
        self.base_digest = base_digest
        fleet = list(dict.fromkeys(url.rstrip("/") for url in urls))
        self._clients = {
            url: WorkerClient(url, api_key, timeout_s=HEALTH_TIMEOUT_S)
            for url in (fleet if self.me in fleet else [])
            if url != self.me
        }
        self._misses = {url: MISSES_TO_LEAVE for url in self._clients}
        """Checks in a row each peer missed; a peer starts gone until it answers."""
        self._lock = threading.Lock()
        self._members: tuple[str, ...] = (self.me,)
        self._asked: dict[tuple[str, RevisionId], float] = {}
        self._pool = ThreadPoolExecutor(max(1, min(8, len(self._clients))), "peers")

    @property
    def fleet(self) -> tuple[str, ...]:
        """Every worker of the fleet as configured, live or not, this one included."""
        return tuple(sorted({self.me, *self._clients}))

    @property
    def members(self) -> tuple[str, ...]:
        """The live workers of this base, this one included, as of the last `refresh`."""
        with self._lock:
            return self._members

    def placement(self, revision: RevisionId, replicas: int) -> tuple[str, ...]:
        """The workers that hold `revision` (`mint_core.planning.placement.place`)."""
        return place(str(revision), self.members, replicas)

    def refresh(self) -> tuple[str, ...]:
        """Ask every peer whether it is up and serves this base; the members now."""
        answers = list(self._pool.map(self._serves_base, self._clients.values()))
        with self._lock:
            for url, answered in zip(self._clients, answers, strict=True):
                self._misses[url] = 0 if answered else self._misses[url] + 1
            live = [url for url, misses in self._misses.items() if misses < MISSES_TO_LEAVE]
            members = tuple(sorted({self.me, *live}))
            if members != self._members:
                log.info("workers of this base: %s", ", ".join(members))
            self._members = members
            return members

    def _serves_base(self, client: WorkerClient) -> bool:
        try:
            return client.health().get("base_digest") == self.base_digest
        except (MintError, ValueError):
            return False

    def ask_admit(self, url: str, revision: RevisionId) -> None:
        """Ask worker `url` to admit `revision` by demand, in the background (at most once per
        ASK_INTERVAL_S for the same revision)."""
        now = time.monotonic()
        with self._lock:
            if now - self._asked.get((url, revision), -ASK_INTERVAL_S) < ASK_INTERVAL_S:
                return
            self._asked[(url, revision)] = now
            if len(self._asked) > 10_000:  # forget the oldest asks
                for key in list(self._asked)[:5_000]:
                    del self._asked[key]
        client = self._clients.get(url)
        if client is not None:
            self._pool.submit(self._admit, client, revision)

    @staticmethod
    def _admit(client: WorkerClient, revision: RevisionId) -> None:
        try:
            client.admit(revision, "demand")
        except MintError as e:
            log.warning("could not ask %s to admit %s: %s", client.url, revision, e)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
