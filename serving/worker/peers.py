"""The other workers of this worker's base, as this worker sees them: who is live (for
placement), and asking the placed worker to admit a revision a request here wanted.

A worker's peers are the fleet's workers other than itself (MINT_WORKER_URL): the roster's
(`mint_core.membership`: MINT_WORKER_URLS, and with MINT_FLEET=registry every worker announcing
itself), read again at each sync, so a worker that joins becomes a peer with nothing restarted.
Each sync asks their `/health` (in parallel, with a short timeout): a peer that answers with this
worker's base digest is live. A worker whose own URL is not in the fleet is not part of it: it
has no peers, and every revision is placed on it. A peer that stops answering stays live for
`MISSES_TO_LEAVE` checks in a row, so that a peer busy for a moment does not move its revisions
back and forth.
"""

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from mint_core.errors import MintError
from mint_core.membership import Roster, StaticRoster
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

    def __init__(self, me: str, roster: Roster | None, base_digest: str, api_key: str = "") -> None:
        """`roster`: the fleet (None: this worker alone)."""
        self.me = me.rstrip("/")
        """This worker, named as the fleet names it."""
        self.base_digest = base_digest
        self._roster = roster or StaticRoster(())
        self._api_key = api_key
        self._clients: dict[str, WorkerClient] = {}
        self._misses: dict[str, int] = {}
        """Checks in a row each peer missed; a peer starts gone until it answers."""
        self._lock = threading.Lock()
        self._fleet: tuple[str, ...] = (self.me,)
        self._members: tuple[str, ...] = (self.me,)
        self._asked: dict[tuple[str, RevisionId], float] = {}
        self._unanswered: set[str] = set()
        """Peers that failed the last admit asked of them, until they answer a health check."""
        self._pool = ThreadPoolExecutor(8, "peers")  # threads start as needed
        self._follow_roster()

    @property
    def fleet(self) -> tuple[str, ...]:
        """Every worker of the fleet, live or not, this one included (as of the last
        `refresh`)."""
        with self._lock:
            return self._fleet

    def _follow_roster(self) -> None:
        """Peers for the roster's fleet as it is now: a newcomer starts gone until it answers,
        a worker out of the fleet is no peer any more."""
        fleet = self._roster.fleet()
        urls = [url for url in fleet if url != self.me] if self.me in fleet else []
        gone = []
        with self._lock:
            for url in set(self._clients) - set(urls):
                gone.append(self._clients.pop(url))
                del self._misses[url]
            for url in urls:
                if url not in self._clients:
                    self._clients[url] = WorkerClient(url, self._api_key, HEALTH_TIMEOUT_S)
                    self._misses[url] = MISSES_TO_LEAVE
            self._fleet = tuple(sorted({self.me, *self._clients}))
        for client in gone:
            client.close()

    @property
    def members(self) -> tuple[str, ...]:
        """The live workers of this base, this one included, as of the last `refresh`."""
        with self._lock:
            return self._members

    def placement(self, revision: RevisionId, replicas: int) -> tuple[str, ...]:
        """The workers that hold `revision` (`mint_core.planning.placement.place`)."""
        return place(str(revision), self.members, replicas)

    def refresh(self) -> tuple[str, ...]:
        """Read the roster again, then ask every peer whether it is up and serves this base;
        the members now."""
        self._roster.refresh()
        self._follow_roster()
        with self._lock:
            clients = dict(self._clients)
        answers = list(self._pool.map(self._serves_base, clients.values()))
        with self._lock:
            for url, answered in zip(clients, answers, strict=True):
                if url in self._misses:
                    self._misses[url] = 0 if answered else self._misses[url] + 1
                if answered:
                    self._unanswered.discard(url)
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
        with self._lock:
            client = self._clients.get(url)
        if client is not None:
            self._pool.submit(self._admit, url, client, revision)

    def answering(self, url: str) -> bool:
        """Whether peer `url` took the last admit asked of it (or has answered a health
        check since it failed one)."""
        with self._lock:
            return url not in self._unanswered

    def _admit(self, url: str, client: WorkerClient, revision: RevisionId) -> None:
        try:
            client.admit(revision, "demand")
        except MintError as e:
            log.warning("could not ask %s to admit %s: %s", url, revision, e)
            with self._lock:
                self._unanswered.add(url)
        else:
            with self._lock:
                self._unanswered.discard(url)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
