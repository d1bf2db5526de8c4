"""A serving worker: its backend (the engine that runs the base and the adapters), the residency
tiers, and each revision's readiness on this worker. The worker keeps the lifecycle and the
gate whatever the backend: MinT's embedded engine or a vLLM server (`serving.backend`).

- **Watcher**: a thread syncs the catalog with the registry every `sync_interval_s` (and when
  nudged) and admits what the registry says this worker should hold (`Catalog.desired`). If
  MLflow is down the worker keeps serving what it has and reports itself `degraded`.
- **Admission**: admitted revisions queue (`mint_core.admission`, rollbacks first) and K
  prewarm threads take them one at a time, in two phases: fetch and verify the artifact into
  the host tier (`fetching`), then load it into the engine and run a warm-up generation
  (`warming`); only then is it `ready`.
- **Readiness gate**: the request path never fetches anything: `route` answers with the engine
  key of a ready revision or raises `RevisionNotReady` at once (and EngineUnavailableError
  while the engine is down). `request_path_loads` counts what a user's request waited for all
  the same: fetches from the artifact store made outside prewarm (the gate keeps them at zero)
  and adapter copies into a device slot made for a user's request (by design when more
  adapters are in use than there are slots; the tier counters break loads down further).
- **Canary**: while an adapter has one (`Registry.start_canary`), `route` sends its share of
  the requests for `name@production` to the canary revision, if that is ready here and the
  caller may use it; otherwise to production, so the canary never fails a request. Each
  answer's outcome is kept per revision (`outcomes`), which is how a canary is judged.
- **Engine restarts**: a backend whose engine dies (vLLM) reports it; every ready revision goes
  back to not admitted, and once the engine is back the watcher admits and prewarms again what
  the registry wants.
- **Tiers**: the residency plan holds the host tier's contents itself: there is no second copy
  to keep in step with it.

- **Held alias moves**: the worker serves an alias where the pipeline moved it
  (`mint_core.alias_intents`). One moved by anyone else (the MLflow UI) is held: the previous
  target keeps serving, `held_moves` reports it (`/health`, `mint status`) and an alias event
  records it, until the pipeline moves the alias (promote, rollback).

Every readiness change is kept in an event log (`events`), and every held alias move that
appears or ends in another (`alias_events`), which is how tests and operators see what
happened and when: the last `EVENT_LOG_LENGTH` of each (`serving.readiness` says what bounds
the worker's memory).

A worker's threads (K prewarm threads and the watcher) start in `start()`, once the worker is
whole; `close()` stops them.

Locks, outermost first (a thread holding one never waits for one above it):

1. `_syncing`: one sync with the registry at a time (the watcher's, `/admin/sync`'s).
2. the catalog's own locks (its index, its registry client).
3. the readiness table's condition (`serving.readiness.ReadinessTable`): entries, policies,
   admission queue, event log, the newest engine generation lost.
4. `_lock`: held alias moves, their events, the count of request-path fetches.
5. the backend's locks (residency tiers, scheduler, vLLM's counters): it calls the worker back
   (`on_lost`) holding none of them.
"""

import contextlib
import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

from mint_core.access import ANONYMOUS, allows, check_access
from mint_core.admission import DEFAULT_CONCURRENCY, Priority
from mint_core.alias_intents import HeldMove
from mint_core.artifact_store import ArtifactStore
from mint_core.catalog import Catalog
from mint_core.errors import (
    BaseMismatchError,
    EngineUnavailableError,
    IntegrityError,
    MintError,
    NotFoundError,
    RegistryError,
)
from mint_core.model.base import BaseText
from mint_core.model.text import TextCodec
from mint_core.packing import load as load_packed
from mint_core.revisions import PRODUCTION, PolicyRecord, RevisionId, RevisionRef
from mint_core.states import Readiness
from serving.backend import Backend
from serving.engine import BASE
from serving.generation import Request
from serving.outcomes import Outcomes
from serving.readiness import (
    EVENT_LOG_LENGTH,
    AliasEvent,
    AliasEventKind,
    ReadinessEntry,
    ReadinessTable,
    Residence,
    RevisionNotReady,
)
from serving.sampling import SamplingParams

log = logging.getLogger(__name__)

WARMUP_TEXT = "Hello"
"""A neutral prompt for the warm-up generation, in the base's own tokens (whatever the base)."""
WARMUP_TOKENS = 2
WARMUP_TIMEOUT_S = 120.0
DEFAULT_SYNC_INTERVAL_S = 1.0
PREWARM_NICENESS = 10
_LOADED = frozenset({Readiness.FETCHING, Readiness.WARMING, Readiness.READY})
"""States in which a revision holds weights on this worker."""


class Worker:
    def __init__(
        self,
        backend: Backend,
        catalog: Catalog,
        store: ArtifactStore,
        admission_k: int = DEFAULT_CONCURRENCY,
        sync_interval_s: float = DEFAULT_SYNC_INTERVAL_S,
    ) -> None:
        self.backend = backend
        self.catalog = catalog
        self.store = store
        self.residency = backend.residency
        self.metrics = backend.metrics
        self.outcomes = Outcomes()
        """Request ids and what happened to each answer, per revision."""
        self.metrics.registry.register(self.outcomes)
        self._draw = random.Random()
        """Which requests for `production` go to a canary."""
        self._readiness = ReadinessTable(admission_k)
        self._lock = threading.Lock()
        """Guards held moves, their events and the request-path fetch count (see the locks)."""
        self._syncing = threading.Lock()
        """One sync at a time: the watcher's and `/admin/sync`'s would admit twice."""
        self._request_path_fetches = 0
        self._prewarming = threading.local()
        """`active` is set on prewarm threads: their fetches are not on the request path."""
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
        # Before any thread runs: an engine lost from now on is heard of.
        backend.on_lost(self._engine_lost)

    def start(self) -> "Worker":
        """Start prewarming (K threads) and following the registry (the watcher); the worker."""
        if self._threads:
            raise RuntimeError("this worker has started already")
        self._threads = [
            threading.Thread(target=self._prewarm_loop, name=f"prewarm-{number}", daemon=True)
            for number in range(self._admission_k)
        ]
        self._threads.append(threading.Thread(target=self._watch, name="watcher", daemon=True))
        for thread in self._threads:
            thread.start()
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
        admitted = []
        for revision in sorted(self.catalog.desired(), key=lambda r: (r.adapter, r.number)):
            if self.readiness(revision).state is Readiness.NOT_ADMITTED:
                self.admit(revision, self._priority(revision))
                admitted.append(revision)
        return admitted

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
            raise RevisionNotReady(entry)
        if (problem := self.backend.problem()) is not None:
            self.metrics.not_ready.inc()
            raise EngineUnavailableError(f"{revision} cannot be served right now: {problem}")
        return revision, str(revision)

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
    ) -> Request:
        """Queue a generation of prompt token ids (the caller encodes: plain or with the chat
        template) for a routed engine key; iterate the request for its tokens. `warm_up` marks
        prewarm's own generation; `streamed` False, an answer nobody reads before its end."""
        return self.backend.submit(prompt_ids, key, params, warm_up, streamed)

    @property
    def request_path_loads(self) -> int:
        """Loads a user's request waited for: fetches from the artifact store outside prewarm,
        and adapter copies into a device slot for a user's request."""
        with self._lock:
            fetches = self._request_path_fetches
        return fetches + self.backend.request_path_loads

    def close(self) -> None:
        """Stop following the registry, prewarming and serving (waiting requests are
        answered with an error)."""
        self._closed.set()
        self._nudge.set()
        self._readiness.wake()
        self.backend.close()
        for thread in self._threads:
            thread.join(timeout=10)
        self.catalog.close()

    # Prewarm.

    def _prewarm_loop(self) -> None:
        """One prewarm thread: the next admitted revision, prewarmed, until the worker closes.
        Supervised: whatever goes wrong with one revision, its own error handling included,
        is logged and the thread goes on to the next (a dead prewarm thread would leave
        admitted revisions queued for good)."""
        # Prewarming is background work: on a busy machine the running batch goes first.
        with contextlib.suppress(AttributeError, OSError):  # per-thread nice: Linux only
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PREWARM_NICENESS)
        self._prewarming.active = True
        while (revision := self._readiness.next_admitted(self._closed)) is not None:
            try:
                self._prewarm_or_fail(revision)
            except Exception:
                log.exception("prewarm of %s ended in an error of its own handling", revision)
            finally:
                self._readiness.finish(revision)

    def _prewarm_or_fail(self, revision: RevisionId) -> None:
        """Prewarm `revision`; if that fails, record why (failed, or dropped when the engine
        is to blame)."""
        try:
            self._prewarm(revision)
        except EngineUnavailableError as e:
            # Not the revision's fault: it is admitted again once the engine is back.
            log.warning("prewarm of %s stopped: %s", revision, e)
            self._drop(revision, str(e))
        except MintError as e:
            log.warning("prewarm of %s failed: %s", revision, e)
            self._fail(revision, str(e))
        except Exception as e:  # a worker must outlive any one bad revision
            log.exception("prewarm of %s crashed", revision)
            self._fail(revision, f"{type(e).__name__}: {e}")

    def _fail(self, revision: RevisionId, reason: str) -> None:
        self.backend.unload(str(revision))
        self._readiness.move(revision, Readiness.FAILED, reason=reason)

    def _drop(self, revision: RevisionId, reason: str) -> None:
        """`revision` no longer serves here (evicted, or the engine lost it) until admitted
        again; the watcher admits it again if the registry still wants it."""
        self.backend.unload(str(revision))
        self._readiness.move(revision, Readiness.NOT_ADMITTED, reason=reason, only_from=_LOADED)

    def _engine_lost(self, generation: int) -> None:
        """The engine of `generation` died with every adapter it held: nothing is ready until
        prewarmed again (the watcher admits what the registry wants once the engine is
        back), and nothing warmed on that engine becomes ready (`ReadinessTable.make_ready`)."""
        for revision in self._readiness.engine_lost(generation):
            self._drop(revision, "the engine restarted")
        self.nudge()

    def _prewarm(self, revision: RevisionId) -> None:
        self._readiness.move(revision, Readiness.FETCHING)
        registered = self.catalog.record(revision)
        self.check_base(registered.policy, revision)
        try:
            adapter = load_packed(self._fetch(registered.artifact_uri))
        except (IntegrityError, NotFoundError) as e:
            # The operator's fix is one command: name it with this revision filled in.
            repair = f"mint repair --adapter {revision.adapter} --revision {revision.number}"
            raise type(e)(f"{e}; to re-export {revision}: {repair}") from e
        index = adapter.index
        if index.content_digest != registered.policy.content_digest:
            raise IntegrityError(
                f"artifact of {revision} has content digest {index.content_digest}, the policy "
                f"record says {registered.policy.content_digest}"
            )
        key = str(revision)
        for evicted in self.backend.stage(key, adapter):
            self._evicted(evicted)

        self._readiness.warming(revision, registered.policy)
        generation = self.backend.generation
        generating: Request | None = None
        try:
            self.backend.load(key)
            prompt = self.codec.encode(WARMUP_TEXT)
            warm_up = SamplingParams(max_new_tokens=WARMUP_TOKENS)
            generating = self.generate(prompt, key, warm_up, warm_up=True, streamed=False)
            generating.result(timeout_s=WARMUP_TIMEOUT_S)
        except MintError as e:
            if generating is not None:
                # A warm-up that timed out still runs, pinning its slot: the weights leave
                # (`_fail`, `_drop`) once it stops, which this makes the next step.
                generating.cancel()
            engine_down = self.backend.problem() is not None
            if engine_down or self._readiness.engine_lost_since(generation):
                # Not the revision's fault: admitted again once the engine is back.
                raise EngineUnavailableError(f"the engine restarted under {revision}: {e}") from e
            raise
        # Ready only if the engine it warmed on still runs: checked against `_engine_lost`.
        self._readiness.make_ready(revision, generation, lambda: self.residency.in_host(key))

    def _fetch(self, uri: str) -> Path:
        if not getattr(self._prewarming, "active", False):
            with self._lock:
                self._request_path_fetches += 1
        return self.store.fetch(uri)

    def _evicted(self, key: str) -> None:
        """`key` left the host cache: it no longer serves here until admitted again."""
        self.backend.unload(key)
        for revision in self._readiness.ready():
            if str(revision) == key:
                self._readiness.move(
                    revision,
                    Readiness.NOT_ADMITTED,
                    reason="evicted from host cache",
                    only_from=frozenset({Readiness.READY}),
                )


def _alias_of(move: HeldMove) -> tuple[str, str]:
    return move.adapter, move.alias
