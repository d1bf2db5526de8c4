"""A serving worker: its backend (the engine that runs the base and the adapters), the residency
tiers, and each revision's readiness on this worker. The worker keeps the lifecycle and the
gate whatever the backend, MinT's embedded engine or a vLLM server (`serving.backends.protocol`):
a request is answered only by a revision ready here, and nothing is fetched on its path.

Its threads start in `start()`, once the worker is whole, and stop in `close()`: a watcher that
syncs the catalog with the registry and admits what is placed here, and K prewarm threads. What
a worker holds, admits by demand, gates, and does when an alias moves outside the pipeline or
its engine restarts: the README, "Running the pieces", "Many adapters, many workers" and "MinT
in front of vLLM" (a canary's share: "Gates"). `Worker` says in which order it takes its locks.
"""

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Sequence

from mint_core.access import ANONYMOUS, allows, check_access
from mint_core.alias_intents import HeldMove
from mint_core.artifacts.stores import ArtifactStore
from mint_core.catalog.catalog import Catalog
from mint_core.config import MintConfig
from mint_core.errors import (
    BaseMismatchError,
    EngineUnavailableError,
    NotFoundError,
    RegistryError,
)
from mint_core.model.base import BaseText
from mint_core.model.text import TextCodec
from mint_core.planning.admission import DEFAULT_CONCURRENCY, Priority
from mint_core.planning.placement import place
from mint_core.planning.residency import Tier
from mint_core.revisions import PRODUCTION, PolicyRecord, RevisionId, RevisionRef
from mint_core.states import Readiness
from serving.backends.protocol import Backend
from serving.engine.engine import BASE
from serving.engine.generation import Generating
from serving.engine.sampling import SamplingParams
from serving.metrics import CatalogCollector
from serving.worker.announce import Announcer
from serving.worker.outcomes import Outcomes
from serving.worker.peers import Peers
from serving.worker.prewarm import Prewarm
from serving.worker.readiness import (
    EVENT_LOG_LENGTH,
    AliasEvent,
    AliasEventKind,
    ReadinessEntry,
    ReadinessTable,
    Residence,
    RevisionNotReady,
    in_order,
)

log = logging.getLogger(__name__)

DEFAULT_SYNC_INTERVAL_S = MintConfig.sync_interval_s


class Worker:
    """A worker (see the module). Every readiness change is kept in an event log (`events`), and
    every held alias move that appears or ends (`alias_events`): the last `EVENT_LOG_LENGTH` of
    each, which is how tests and operators see what happened and when.

    Locks, outermost first (a thread holding one never waits for one above it):

    1. `_syncing`: one sync with the registry at a time (the watcher's, `/admin/sync`'s).
    2. the catalog's own locks (its index, its registry client).
    3. the readiness table's condition (`serving.worker.readiness.ReadinessTable`): entries,
       policies, admission queue, event log, the newest engine generation lost.
    4. `_lock`: held alias moves and their events; apart, `Prewarm`'s count of request-path
       fetches (a leaf: nothing is taken under it).
    5. the backend's locks (residency tiers, scheduler, vLLM's counters): it calls the worker
       back (`on_lost`) holding none of them.
    """

    def __init__(
        self,
        backend: Backend,
        catalog: Catalog,
        store: ArtifactStore,
        admission_k: int = DEFAULT_CONCURRENCY,
        sync_interval_s: float = DEFAULT_SYNC_INTERVAL_S,
        peers: Peers | None = None,
        replicas: int = MintConfig.replicas,
        announcer: Announcer | None = None,
    ) -> None:
        self.backend = backend
        self.peers = peers or Peers("this worker", None, "")
        """The live workers of this base, for placement (None: this worker alone)."""
        self.announcer = announcer
        """Its heartbeat to the fleet, from `start` to `close` (MINT_FLEET=registry)."""
        self.replicas = replicas
        """Workers that hold each revision, unless its adapter's gates say otherwise."""
        self.catalog = catalog
        self.store = store
        self.residency = backend.residency
        self.metrics = backend.metrics
        self.outcomes = Outcomes()
        """Request ids and what happened to each answer, per revision."""
        self.metrics.registry.register(self.outcomes)
        self.metrics.registry.register(CatalogCollector(catalog))
        self._draw = random.Random()
        """Which requests for `production` go to a canary."""
        self._readiness = ReadinessTable(admission_k)
        self._lock = threading.Lock()
        """Guards held moves and their events (see the locks)."""
        self._syncing = threading.Lock()
        """One sync at a time: the watcher's and `/admin/sync`'s would admit twice."""
        self._held: frozenset[HeldMove] = frozenset()
        """The held alias moves as of the last sync."""
        self._alias_events: deque[AliasEvent] = deque(maxlen=EVENT_LOG_LENGTH)
        self._registry_problem: str | None = None
        """Why the last sync with the registry failed; None while it succeeds."""
        self.sync_interval_s = sync_interval_s
        self._admission_k = admission_k
        self._nudge = threading.Event()
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._prewarm = Prewarm(
            backend, catalog, store, self._readiness, self.check_base, self._closed, self.nudge
        )
        # Before any thread runs: an engine lost from now on is heard of.
        backend.on_lost(self._prewarm.engine_lost)

    def start(self) -> "Worker":
        """Start prewarming (K threads) and following the registry (the watcher); the worker."""
        if self._threads:
            raise RuntimeError("this worker has started already")
        self._threads = [
            threading.Thread(target=self._prewarm.run, name=f"prewarm-{number}", daemon=True)
            for number in range(self._admission_k)
        ]
        self._threads.append(threading.Thread(target=self._watch, name="watcher", daemon=True))
        for thread in self._threads:
            thread.start()
        if self.announcer is not None:
            self.announcer.start()
        return self

    # Readiness.

    def readiness(self, revision: RevisionId) -> ReadinessEntry:
        return self._readiness.entry(revision)

    def entries(self, adapter: str) -> list[ReadinessEntry]:
        return self._readiness.entries(adapter)

    def events(self) -> list[ReadinessEntry]:
        """The last EVENT_LOG_LENGTH readiness changes, oldest first."""
        return self._readiness.events()

    def ready_revisions(self, principal: str = ANONYMOUS) -> list[RevisionId]:
        """Ready revisions `principal` may use."""
        return self._readiness.ready(principal)

    def adapter_status(
        self, adapter: str, principal: str, sees_all: bool
    ) -> list[tuple[ReadinessEntry, Residence]]:
        """Each revision of `adapter` this worker has an entry for, with where its weights
        are: the ones `principal` may use, or all if it `sees_all` (an admin, or a worker
        without API keys). NotFoundError for an adapter the registry does not know. None
        allowed at all is refused as generation refuses it (403 naming the adapter): the
        adapter's existence is no secret from a caller generation already tells, and 404
        would send it looking for a typo."""
        entries = self.entries(adapter)
        if not entries and not self.catalog.knows(adapter):
            raise NotFoundError(f"adapter {adapter!r} is not registered")
        if not sees_all:
            policies = {e.revision: self.catalog.record(e.revision).policy for e in entries}
            allowed = [e for e in entries if allows(policies[e.revision], principal)]
            if entries and not allowed:
                newest = entries[-1].revision
                check_access(policies[newest], principal, newest)
            entries = allowed
        pins = {slot.key: slot.pins for slot in self.residency.slot_table()}
        return [(entry, self._residence(str(entry.revision), pins)) for entry in entries]

    def _residence(self, key: str, pins: dict[str, int]) -> Residence:
        slot = self.residency.slot_of(key)
        return Residence(self.residency.in_host(key), slot, pins.get(key, 0))

    # Admission.

    def admit(self, revision: RevisionId, priority: Priority = Priority.NORMAL) -> ReadinessEntry:
        """Queue `revision` for prewarm. Idempotent: a queued, prewarming or ready revision
        stays as it is (a queued one moves up if `priority` is higher)."""
        return self._readiness.admit(revision, priority)

    def sync(self) -> list[RevisionId]:
        """Catch up with the registry and admit what it says this worker should hold but does
        not; the revisions admitted. A failed sync marks the worker degraded and changes
        nothing else. One at a time: the watcher's and `/admin/sync`'s."""
        with self._syncing:
            return self._sync()

    def _sync(self) -> list[RevisionId]:
        self.peers.refresh()
        try:
            self.catalog.sync()
        except RegistryError as e:
            if self._registry_problem is None:
                log.warning("registry unreachable; serving what this worker holds: %s", e)
            self._registry_problem = str(e)
            raise
        self._registry_problem = None
        self._note_held_moves()
        if self.backend.problem() is not None:
            return []  # nothing can load now; admitted once the engine is back
        targets = self.catalog.serving_targets()
        self.residency.protect(str(revision) for revision in targets.pins)
        admitted: list[RevisionId] = []

        def take(revision: RevisionId, priority: Priority) -> bool:
            if self.readiness(revision).state is not Readiness.NOT_ADMITTED:
                return False
            self.admit(revision, priority)
            admitted.append(revision)
            return True

        for revision in in_order(targets.pins):
            take(revision, Priority.NORMAL)
        for revision in in_order(targets.rollout):
            if self.placed_here(revision):
                take(revision, self._priority(revision))
        # Production revisions placed here fill free room only: evicting one for another
        # nobody asked for is the thrashing placement exists to prevent. Demand brings the rest
        # (and, while a worker of the fleet is down, its share: placed by the whole fleet as
        # configured, a prefill never takes what its worker will hold again once back).
        room = self.residency.room() - self._readiness.admitting
        whole_fleet = self.peers.fleet
        for revision in in_order(targets.production):
            if room <= 0:
                break
            placed = place(str(revision), whole_fleet, self._replicas_of(revision))
            if self.peers.me in placed and take(revision, Priority.PREFILL):
                room -= 1
        return admitted

    def _replicas_of(self, revision: RevisionId) -> int:
        return self.catalog.replicas(revision.adapter) or self.replicas

    def placement(self, revision: RevisionId) -> tuple[str, ...]:
        """The workers of this base that hold `revision`, by the members this worker sees."""
        return self.peers.placement(revision, self._replicas_of(revision))

    def placed_here(self, revision: RevisionId) -> bool:
        return self.peers.me in self.placement(revision)

    def _note_held_moves(self) -> None:
        """Record held alias moves that appeared or ended since the last sync."""
        held = frozenset(self.catalog.held_moves())
        now = time.time()
        with self._lock:
            seen, self._held = self._held, held
            for move in sorted(held - seen, key=_alias_of):
                log.warning("%s", move.describe())
                self._alias_events.append(AliasEvent(now, AliasEventKind.HELD, move))
            for move in sorted(seen - held, key=_alias_of):
                log.info("%s@%s follows the pipeline again", move.adapter, move.alias)
                self._alias_events.append(AliasEvent(now, AliasEventKind.RELEASED, move))

    @property
    def held_moves(self) -> list[HeldMove]:
        """Aliases the registry points where the pipeline did not move them; each keeps
        serving the pipeline's last target here."""
        with self._lock:
            return sorted(self._held, key=_alias_of)

    def alias_events(self) -> list[AliasEvent]:
        """The last EVENT_LOG_LENGTH held alias moves that appeared or ended, oldest first."""
        with self._lock:
            return list(self._alias_events)

    def nudge(self) -> None:
        """Sync now rather than at the next interval."""
        self._nudge.set()

    def _priority(self, revision: RevisionId) -> Priority:
        """A revision older than one this worker has ready is a rollback: it goes first."""
        newer = self._readiness.newer_ready(revision)
        return Priority.ROLLBACK if newer else Priority.NORMAL

    def _watch(self) -> None:
        while not self._closed.is_set():
            try:
                self.sync()
            except RegistryError:
                pass  # recorded in `degraded`; try again at the next interval
            except Exception:  # the watcher must outlive any one bad sync
                log.exception("sync with the registry failed")
            self._nudge.wait(self.sync_interval_s)
            self._nudge.clear()

    # Serving.

    @property
    def degraded(self) -> str | None:
        """Why the worker cannot do all its work (registry unreachable, engine down); None
        while it can."""
        return self.backend.problem() or self._registry_problem

    @property
    def last_sync(self) -> float | None:
        """Unix time of the last sync with the registry that succeeded."""
        return self.catalog.last_sync

    @property
    def backend_kind(self) -> str:
        """The engine: `embedded` or `vllm`."""
        return self.backend.kind

    def exposition(self) -> bytes:
        """The worker's Prometheus metrics, in the text format."""
        return self.metrics.exposition()

    @property
    def codec(self) -> TextCodec:
        """The base's tokenizer and chat template: prompts are encoded with it."""
        return self.backend.text.codec

    @property
    def base(self) -> BaseText:
        """The resident base: model id, digest, family, context length."""
        return self.backend.text

    @property
    def queue_depth(self) -> int:
        """Generations waiting to join the running batch."""
        return self.backend.queue_depth

    @property
    def batch_size(self) -> int:
        """Generations running now."""
        return self.backend.batch_size

    def route(
        self, ref: RevisionRef | None, principal: str = ANONYMOUS, admin: bool = False
    ) -> tuple[RevisionId | None, str]:
        """The revision `ref` names and its engine key, if `principal` may use it (an `admin`
        may use every revision: the evaluation gate scores revisions of any team) and it is
        ready here (for `name@production`, the canary revision for the canary's share of the
        requests: see `_canary`); never loads. NotFoundError for an unknown adapter or revision,
        AccessDeniedError, or RevisionNotReady."""
        if ref is None:
            return None, BASE
        registered = self.catalog.resolve(ref)
        revision = registered.id
        if not admin:
            check_access(registered.policy, principal, revision)
        self.check_base(registered.policy, revision)
        if ref.alias == PRODUCTION and (canary := self._canary(ref.adapter, principal, admin)):
            return canary, str(canary)
        entry = self.readiness(revision)
        if entry.state is not Readiness.READY:
            self.metrics.not_ready.inc()
            if (
                entry.state is Readiness.NOT_ADMITTED
                and self.backend.problem() is None
                and self.catalog.in_front_of_users(registered)
            ):
                entry = self._demand(revision)
            raise RevisionNotReady(entry, self._readiness.wait_estimate(entry))
        if (problem := self.backend.problem()) is not None:
            self.metrics.not_ready.inc()
            raise EngineUnavailableError(f"{revision} cannot be served right now: {problem}")
        return revision, str(revision)

    def _demand(self, revision: RevisionId) -> ReadinessEntry:
        """A request wants `revision`, admitted nowhere here: admit it by demand where it is
        placed (here, or by asking the placed worker); its entry here now."""
        placed = self.placement(revision)
        # A placed worker that failed the last ask (cut off, down) still counts as live until
        # it misses MISSES_TO_LEAVE health checks: meanwhile this worker, which the gateway sent
        # the request to, admits it rather than answer "not ready" for seconds more.
        if self.peers.me in placed or not self.peers.answering(placed[0]):
            self.metrics.demand_admissions.inc()
            return self.admit(revision, Priority.DEMAND)
        self.peers.ask_admit(placed[0], revision)
        return self.readiness(revision)

    def _canary(self, adapter: str, principal: str, admin: bool) -> RevisionId | None:
        """The canary revision, for this request to `adapter@production` if it is drawn into
        the canary's share and the canary can serve it here: ready (so of this worker's base:
        prewarm checked it), allowed to `principal`, the engine up. None: production serves."""
        canary = self.catalog.canary(adapter)
        if canary is None:
            return None
        revision, percent = canary
        if self._draw.random() * 100 >= percent:
            return None
        if not self._readiness.serves(revision, None if admin else principal):
            return None
        return revision if self.backend.problem() is None else None

    def check_base(self, policy: PolicyRecord, revision: RevisionId) -> None:
        """BaseMismatchError naming both bases unless `revision` was trained on this worker's
        base: a worker never admits nor serves another base's revision."""
        base = self.base
        if policy.base_digest != base.digest:
            raise BaseMismatchError(
                f"{revision} was trained on the base {policy.base_model_id} "
                f"({policy.base_digest}); this worker serves {base.model_id} ({base.digest}): "
                "send it to a worker of that base (or through `mint gateway`)"
            )

    def admit_known(self, revision: RevisionId, priority: Priority) -> ReadinessEntry:
        """`admit` a revision the registry knows (NotFoundError if not) and that this worker's
        base can serve (BaseMismatchError if not): the admin endpoint's admission."""
        registered = self.catalog.record(revision)
        self.check_base(registered.policy, revision)
        return self.admit(registered.id, priority)

    def routing(self) -> tuple[list[RevisionId], list[str]]:
        """What a gateway routes by: the ready revisions, and the engine keys in device slots."""
        slots = [entry.key for entry in self.residency.slot_table()]
        return self._readiness.ready(), slots

    def generate(
        self,
        prompt_ids: Sequence[int],
        key: str,
        params: SamplingParams,
        warm_up: bool = False,
        streamed: bool = True,
        principal: str = ANONYMOUS,
    ) -> Generating:
        """Queue a generation of prompt token ids (the caller encodes: plain or with the chat
        template) for a routed engine key; iterate the request for its tokens. `warm_up` marks
        prewarm's own generation; `streamed` False, an answer nobody reads before its end;
        `principal`: who asked, for its fair share."""
        return self.backend.submit(prompt_ids, key, params, warm_up, streamed, principal)

    def tiers(self) -> dict[str, dict[str, int | None]]:
        """Each residency tier's occupancy, bound and counters since start (`/health`,
        `mint status`)."""
        residency = self.residency
        held = {
            "host": (residency.host_revisions, residency.host_capacity_entries),
            "device": (len(residency.slot_table()), residency.device_slots),
        }
        return {
            tier.value: {
                "revisions": held[tier.value][0],
                "capacity": held[tier.value][1],
                **vars(residency.counters[tier]),
            }
            for tier in Tier
        }

    @property
    def request_path_fetches(self) -> int:
        """Fetches from the artifact store outside prewarm: what the readiness gate keeps at
        zero."""
        return self._prewarm.request_path_fetches

    @property
    def request_path_loads(self) -> int:
        """Loads a user's request waited for: fetches from the artifact store outside prewarm,
        and adapter copies into a device slot for a user's request."""
        return self._prewarm.request_path_fetches + self.backend.request_path_loads

    def leave(self) -> None:
        """Tell the fleet this worker is leaving (its heartbeat's record: readers leave it out
        of placement and routing); it serves on until `close` (`serving.worker.leaving`)."""
        if self.announcer is not None:
            self.announcer.leaving()

    def close(self) -> None:
        """Stop following the registry, prewarming and serving (waiting requests are
        answered with an error); first, leave the fleet, so that nobody sends it more."""
        if self.announcer is not None:
            self.announcer.stop()
        self._closed.set()
        self._nudge.set()
        self._readiness.wake()
        self.backend.close()
        for thread in self._threads:
            thread.join(timeout=10)
        self.peers.close()
        self.catalog.close()


def _alias_of(move: HeldMove) -> tuple[str, str]:
    return move.adapter, move.alias
