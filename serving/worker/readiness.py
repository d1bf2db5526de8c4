"""Each revision's readiness on one worker (`ReadinessTable`), and the records the worker shows
of it: entries, the "not ready" error, held alias moves' events. Nothing here loads an engine,
so the HTTP layer and the gateway can name these records without loading torch.

The table is one lock's worth of state: the entries, the policy records of revisions warmed
here, the admission queue (which entries wait for prewarm, and their order), the event log,
and the newest engine generation lost. Prewarm threads wait on its condition for work.

Memory is bounded whatever the traffic: entries that serve or are on their way (queued to
ready) are what the registry and admins admitted here, held in the host tier or waiting for
it; entries that stopped (not admitted again, failed: kept for their reason) are the last
`INACTIVE_ENTRIES`, older ones read as never admitted; the event log keeps the last
`EVENT_LOG_LENGTH` changes.
"""

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum

from mint_core.access import allows
from mint_core.alias_intents import HeldMove
from mint_core.errors import EngineUnavailableError, NotReadyError
from mint_core.planning.admission import AdmissionQueue, Priority
from mint_core.revisions import PolicyRecord, RevisionId
from mint_core.states import Readiness, transition

__all__ = [
    "EVENT_LOG_LENGTH",
    "INACTIVE_ENTRIES",
    "AliasEvent",
    "AliasEventKind",
    "ReadinessEntry",
    "ReadinessTable",
    "Residence",
    "RevisionNotReady",
    "in_order",
]

EVENT_LOG_LENGTH = 10_000
"""Readiness changes a worker keeps for `/admin/events` (and, apart, held alias moves'
events): the newest, about 200 bytes each."""
INACTIVE_ENTRIES = 10_000
"""Revisions that stopped serving here (not admitted, failed) whose entry a worker keeps,
with its reason: the most recent."""
_ACTIVE = frozenset({Readiness.QUEUED, Readiness.FETCHING, Readiness.WARMING, Readiness.READY})
FIRST_PREWARM_S = 0.5
"""What a prewarm is taken to last before one has been timed."""
SHORTEST_WAIT_S = 0.05
"""The least wait a "not ready" answer suggests."""
_PREWARM_WEIGHT = 0.2
"""How much each new prewarm time moves the running mean."""


@dataclass(frozen=True)
class ReadinessEntry:
    """One revision's state on this worker."""

    revision: RevisionId
    state: Readiness
    since: float
    """Unix time the revision entered `state`."""
    reason: str | None = None
    """Why it failed, for `failed`."""
    queue_position: int | None = None
    """For `queued`: how many queued revisions go before it."""


class AliasEventKind(StrEnum):
    HELD = "held"
    """An alias moved outside the pipeline: the worker keeps serving the previous target."""
    RELEASED = "released"
    """The pipeline moved the alias (or the registry's alias came back): followed again."""


@dataclass(frozen=True)
class AliasEvent:
    """A held alias move appearing or ending on this worker."""

    at: float
    """Unix time the worker saw it."""
    kind: AliasEventKind
    move: HeldMove


@dataclass(frozen=True)
class Residence:
    """Where one revision's weights are on this worker (`/v1/adapters/{name}`)."""

    host: bool
    """In the host tier."""
    device_slot: int | None
    """Its device slot, if it is in one."""
    pins: int
    """Requests running on its device slot now."""


class RevisionNotReady(NotReadyError):
    def __init__(self, entry: ReadinessEntry, retry_after_s: float | None = None) -> None:
        super().__init__(f"{entry.revision} is {entry.state} on this worker, not ready")
        self.entry = entry
        self.retry_after_s = retry_after_s
        """When it may be ready, estimated from the admission queue; None: no estimate."""


def in_order(revisions: Iterable[RevisionId]) -> list[RevisionId]:
    """By adapter, then revision number."""
    return sorted(revisions, key=lambda r: (r.adapter, r.number))


class ReadinessTable:
    """Every revision's readiness on one worker, its admission queue and its event log; safe
    to use from every thread. Moves go through `mint_core.states.transition`."""

    def __init__(self, admission_k: int) -> None:
        self._changed = threading.Condition()
        """Guards everything below; prewarm threads wait on it for admitted revisions."""
        self._entries: dict[RevisionId, ReadinessEntry] = {}
        self._inactive: OrderedDict[RevisionId, None] = OrderedDict()
        """Entries not active, oldest first: the ones dropped past INACTIVE_ENTRIES."""
        self._policies: dict[RevisionId, PolicyRecord] = {}
        """Of revisions warmed here: who may use them."""
        self._events: deque[ReadinessEntry] = deque(maxlen=EVENT_LOG_LENGTH)
        self._admission: AdmissionQueue[RevisionId] = AdmissionQueue(admission_k)
        self._lost_generation = -1
        """The newest engine generation known lost: nothing loaded on it may become ready."""
        self._prewarm_s = FIRST_PREWARM_S
        """Recent prewarms' mean duration (exponentially weighted)."""

    # Reading.

    def entry(self, revision: RevisionId) -> ReadinessEntry:
        with self._changed:
            return self._entry(revision)

    def entries(self, adapter: str) -> list[ReadinessEntry]:
        with self._changed:
            found = [self._entry(r) for r in self._entries if r.adapter == adapter]
        return sorted(found, key=lambda e: e.revision.number)

    def events(self) -> list[ReadinessEntry]:
        """The last EVENT_LOG_LENGTH readiness changes, oldest first."""
        with self._changed:
            return list(self._events)

    def ready(self, principal: str | None = None) -> list[RevisionId]:
        """Ready revisions, those `principal` may use if one is named."""
        with self._changed:
            return in_order([r for r in self._entries if self._serves(r, principal)])

    def serves(self, revision: RevisionId, principal: str | None = None) -> bool:
        """Whether `revision` is ready (and `principal`, if named, may use it)."""
        with self._changed:
            return self._serves(revision, principal)

    def newer_ready(self, revision: RevisionId) -> bool:
        """Whether a newer revision of the same adapter is ready: `revision` is a rollback."""
        with self._changed:
            return any(
                r.adapter == revision.adapter and r.number > revision.number and self._serves(r)
                for r in self._entries
            )

    @property
    def admitting(self) -> int:
        """Revisions queued or prewarming."""
        with self._changed:
            return len(self._admission)

    def wait_estimate(self, entry: ReadinessEntry) -> float | None:
        """Seconds until `entry`'s revision may be ready, from the recent prewarms' duration
        and the revisions before it in the queue (K at a time), or for a prewarm already
        late, from how long it has taken so far; None for a failed one (it is not coming
        without an operator)."""
        if entry.state is Readiness.FAILED:
            return None
        with self._changed:
            each = self._prewarm_s
            concurrency = self._admission.concurrency
        if entry.state is Readiness.QUEUED:
            ahead = entry.queue_position or 0
            wait = (ahead // concurrency + 1) * each
        elif entry.state in (Readiness.FETCHING, Readiness.WARMING):
            elapsed = time.time() - entry.since
            # Past its estimate, a prewarm is taken to last half as long again as it has so
            # far: each late answer suggests a longer wait, so a client's retries spread over
            # a slow fetch (a cold store, a failover's first load) instead of being spent at
            # the floor in a burst (measured: 20 retries in 3.8 s while a fetch took 6 s).
            wait = max(each - elapsed, elapsed / 2)
        else:  # not admitted here: admitted on its placement meanwhile
            wait = each
        return max(SHORTEST_WAIT_S, wait)

    def prewarmed(self, seconds: float) -> None:
        """A prewarm took `seconds`, fetch to ready: the next waits are estimated from it."""
        with self._changed:
            self._prewarm_s += _PREWARM_WEIGHT * (seconds - self._prewarm_s)

    def engine_lost_since(self, generation: int) -> bool:
        """Whether the engine of `generation` (or a newer one) is known lost."""
        with self._changed:
            return generation <= self._lost_generation

    def _serves(self, revision: RevisionId, principal: str | None = None) -> bool:
        entry = self._entries.get(revision)
        if entry is None or entry.state is not Readiness.READY:
            return False
        return principal is None or allows(self._policies[revision], principal)

    def _entry(self, revision: RevisionId) -> ReadinessEntry:
        entry = self._entries.get(revision)
        if entry is None:
            return ReadinessEntry(revision, Readiness.NOT_ADMITTED, since=0.0)
        if entry.state is Readiness.QUEUED:
            position = self._admission.position(revision)
            return ReadinessEntry(revision, entry.state, entry.since, queue_position=position)
        return entry

    # Moving.

    def move(
        self,
        revision: RevisionId,
        state: Readiness,
        reason: str | None = None,
        only_from: frozenset[Readiness] | None = None,
    ) -> bool:
        """Move `revision` to `state`, if it is in one of `only_from` (any state, if None);
        whether it moved. `transition` refuses a move the table of states does not allow."""
        with self._changed:
            if only_from is not None and self._entry(revision).state not in only_from:
                return False
            self._set(revision, state, reason)
            return True

    def warming(self, revision: RevisionId, policy: PolicyRecord) -> None:
        """`revision` is in the host tier and goes into the engine: from now on its policy
        record says who may use it."""
        with self._changed:
            self._policies[revision] = policy
            self._set(revision, Readiness.WARMING)

    def make_ready(
        self, revision: RevisionId, generation: int, in_host: Callable[[], bool]
    ) -> bool:
        """Make `revision`, warmed up on the engine of `generation`, ready; whether it is. Not
        if another prewarm evicted it from the host tier meanwhile (`in_host()` False: it goes
        back to not admitted); EngineUnavailableError if that engine is known lost. Both are
        checked under the lock that `engine_lost` and an eviction's move take: either this
        comes first and they drop the revision, or they did and this sees it."""
        with self._changed:
            if generation <= self._lost_generation:
                raise EngineUnavailableError(
                    f"the engine restarted while {revision} warmed up (generation {generation})"
                )
            if not in_host():
                self._set(revision, Readiness.NOT_ADMITTED, reason="evicted from host cache")
                return False
            self._set(revision, Readiness.READY)
            return True

    def engine_lost(self, generation: int) -> list[RevisionId]:
        """The engine of `generation` died with every adapter it held: nothing warmed on it
        becomes ready from now on. The revisions ready now, for the caller to drop."""
        with self._changed:
            self._lost_generation = max(self._lost_generation, generation)
            return in_order([r for r in self._entries if self._serves(r)])

    def _set(self, revision: RevisionId, state: Readiness, reason: str | None = None) -> None:
        current = self._entries.get(revision)
        transition(current.state if current else Readiness.NOT_ADMITTED, state)
        entry = ReadinessEntry(revision, state, since=time.time(), reason=reason)
        self._entries[revision] = entry
        self._events.append(entry)
        self._inactive.pop(revision, None)
        if state in _ACTIVE:
            return
        self._inactive[revision] = None
        if len(self._inactive) > INACTIVE_ENTRIES:
            oldest, _ = self._inactive.popitem(last=False)
            del self._entries[oldest]
            self._policies.pop(oldest, None)

    # Admission.

    def admit(self, revision: RevisionId, priority: Priority) -> ReadinessEntry:
        """Queue `revision` for prewarm. Idempotent: a queued, prewarming or ready revision
        stays as it is (a queued one moves up if `priority` is higher)."""
        with self._changed:
            state = self._entry(revision).state
            if state in (Readiness.NOT_ADMITTED, Readiness.FAILED):
                self._set(revision, Readiness.QUEUED)
            if state in (Readiness.NOT_ADMITTED, Readiness.FAILED, Readiness.QUEUED):
                self._admission.push(revision, priority)
                self._changed.notify_all()
            elif self._admission.started_as(revision) is not None:
                self._admission.push(revision, priority)  # a running prefill a request now wants
            return self._entry(revision)

    def next_admitted(self, closed: threading.Event) -> RevisionId | None:
        """The next revision to prewarm, once there is one and a prewarm slot is free (K at a
        time); None once `closed` is set and `wake` called."""
        with self._changed:
            while not closed.is_set():
                if (revision := self._admission.start_next()) is not None:
                    return revision
                self._changed.wait()
            return None

    def started_as(self, revision: RevisionId) -> Priority | None:
        """The priority `revision`'s running prewarm started at (None: none runs)."""
        with self._changed:
            return self._admission.started_as(revision)

    def finish(self, revision: RevisionId) -> None:
        """The prewarm of `revision` ended, however: its slot is free for the next one."""
        with self._changed:
            self._admission.finish(revision)
            self._changed.notify_all()

    def wake(self) -> None:
        """Wake every prewarm thread waiting for work (to see that the worker closed)."""
        with self._changed:
            self._changed.notify_all()
