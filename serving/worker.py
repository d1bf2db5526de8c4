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
happened and when.
"""

import contextlib
import logging
import os
import random
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from mint_core.access import ANONYMOUS, allows, check_access
from mint_core.admission import DEFAULT_CONCURRENCY, AdmissionQueue, Priority
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
from mint_core.states import Readiness, transition
from serving.backend import Backend
from serving.engine import BASE
from serving.generation import Request
from serving.outcomes import Outcomes
from serving.readiness import AliasEvent, AliasEventKind, ReadinessEntry, RevisionNotReady
from serving.sampling import SamplingParams

log = logging.getLogger(__name__)

WARMUP_TEXT = "Hello"
"""A neutral prompt for the warm-up generation, in the base's own tokens (whatever the base)."""
WARMUP_TOKENS = 2
WARMUP_TIMEOUT_S = 120.0
DEFAULT_SYNC_INTERVAL_S = 1.0
PREWARM_NICENESS = 10


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
        self._table: dict[RevisionId, ReadinessEntry] = {}
        self._policies: dict[RevisionId, PolicyRecord] = {}
        self._events: list[ReadinessEntry] = []
        """Every readiness change, oldest first."""
        self._admission: AdmissionQueue[RevisionId] = AdmissionQueue(admission_k)
        self._lock = threading.Condition()
        self._request_path_fetches = 0
        self._prewarming = threading.local()
        """`active` is set on prewarm threads: their fetches are not on the request path."""
        self._held: frozenset[HeldMove] = frozenset()
        """The held alias moves as of the last sync."""
        self._alias_events: list[AliasEvent] = []
        self._registry_problem: str | None = None
        """Why the last sync with the registry failed; None while it succeeds."""
        self.sync_interval_s = sync_interval_s
        self._nudge = threading.Event()
        self._closed = threading.Event()
        self._threads = [
            threading.Thread(target=self._prewarm_loop, name=f"prewarm-{number}", daemon=True)
            for number in range(admission_k)
        ]
        self._threads.append(threading.Thread(target=self._watch, name="watcher", daemon=True))
        for thread in self._threads:
            thread.start()
        backend.on_lost(self._engine_lost)

    # Readiness.

    def readiness(self, revision: RevisionId) -> ReadinessEntry:
        with self._lock:
            return self._entry(revision)

    def entries(self, adapter: str) -> list[ReadinessEntry]:
        with self._lock:
            found = [self._entry(r) for r in self._table if r.adapter == adapter]
        return sorted(found, key=lambda e: e.revision.number)

    def events(self) -> list[ReadinessEntry]:
        with self._lock:
            return list(self._events)

    def ready_revisions(self, principal: str = ANONYMOUS) -> list[RevisionId]:
        """Ready revisions `principal` may use."""
        with self._lock:
            return sorted(
                (
                    r
                    for r, e in self._table.items()
                    if e.state is Readiness.READY and allows(self._policies[r], principal)
                ),
                key=lambda r: (r.adapter, r.number),
            )

    def _entry(self, revision: RevisionId) -> ReadinessEntry:
        entry = self._table.get(revision)
        if entry is None:
            return ReadinessEntry(revision, Readiness.NOT_ADMITTED, since=0.0)
        if entry.state is Readiness.QUEUED:
            position = self._admission.position(revision)
            return ReadinessEntry(revision, entry.state, entry.since, queue_position=position)
        return entry

    def _set(
        self, revision: RevisionId, state: Readiness, reason: str | None = None
    ) -> ReadinessEntry:
        """Move `revision` to `state` (the caller holds the lock)."""
        current = self._table.get(revision)
        transition(current.state if current else Readiness.NOT_ADMITTED, state)
        entry = ReadinessEntry(revision, state, since=time.time(), reason=reason)
        self._table[revision] = entry
        self._events.append(entry)
        return entry

    # Admission.

    def admit(self, revision: RevisionId, priority: Priority = Priority.NORMAL) -> ReadinessEntry:
        """Queue `revision` for prewarm. Idempotent: a queued, prewarming or ready revision
        stays as it is (a queued one moves up if `priority` is higher)."""
        with self._lock:
            state = self._entry(revision).state
            if state in (Readiness.NOT_ADMITTED, Readiness.FAILED):
                self._set(revision, Readiness.QUEUED)
            if state in (Readiness.NOT_ADMITTED, Readiness.FAILED, Readiness.QUEUED):
                self._admission.push(revision, priority)
                self._lock.notify_all()
            return self._entry(revision)

    def sync(self) -> list[RevisionId]:
        """Catch up with the registry and admit what it says this worker should hold but does
        not; the revisions admitted. A failed sync marks the worker degraded and changes
        nothing else."""
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
        with self._lock:
            return list(self._alias_events)

    def nudge(self) -> None:
        """Sync now rather than at the next interval."""
        self._nudge.set()

    def _priority(self, revision: RevisionId) -> Priority:
        """A revision older than one this worker has ready is a rollback: it goes first."""
        with self._lock:
            newer = any(
                r.adapter == revision.adapter and r.number > revision.number
                for r, e in self._table.items()
                if e.state is Readiness.READY
            )
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
        with self._lock:
            entry = self._table.get(revision)
            if entry is None or entry.state is not Readiness.READY:
                return None
            if not admin and not allows(self._policies[revision], principal):
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
        with self._lock:
            ready = [r for r, e in self._table.items() if e.state is Readiness.READY]
        slots = [entry.key for entry in self.residency.slot_table()]
        return sorted(ready, key=lambda r: (r.adapter, r.number)), slots

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
        with self._lock:
            self._lock.notify_all()
        self.backend.close()
        for thread in self._threads:
            thread.join(timeout=10)
        self.catalog.close()

    # Prewarm.

    def _prewarm_loop(self) -> None:
        # Prewarming is background work: on a busy machine the running batch goes first.
        with contextlib.suppress(AttributeError, OSError):  # per-thread nice: Linux only
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PREWARM_NICENESS)
        self._prewarming.active = True
        while True:
            revision = None
            with self._lock:
                while (
                    not self._closed.is_set() and (revision := self._admission.start_next()) is None
                ):
                    self._lock.wait()
            if revision is None:
                return  # closed
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
            finally:
                with self._lock:
                    self._admission.finish(revision)
                    self._lock.notify_all()

    def _fail(self, revision: RevisionId, reason: str) -> None:
        self.backend.unload(str(revision))
        with self._lock:
            self._set(revision, Readiness.FAILED, reason=reason)

    def _drop(self, revision: RevisionId, reason: str) -> None:
        """`revision` no longer serves here (evicted, or the engine lost it) until admitted
        again; the watcher admits it again if the registry still wants it."""
        self.backend.unload(str(revision))
        with self._lock:
            if self._entry(revision).state in (
                Readiness.FETCHING,
                Readiness.WARMING,
                Readiness.READY,
            ):
                self._set(revision, Readiness.NOT_ADMITTED, reason=reason)

    def _engine_lost(self) -> None:
        """The engine died with every adapter it held: nothing is ready until prewarmed
        again (the watcher admits what the registry wants once the engine is back)."""
        with self._lock:
            held = [r for r, e in self._table.items() if e.state is Readiness.READY]
        for revision in held:
            self._drop(revision, "the engine restarted")
        self.nudge()

    def _prewarm(self, revision: RevisionId) -> None:
        with self._lock:
            self._set(revision, Readiness.FETCHING)
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

        with self._lock:
            self._policies[revision] = registered.policy
            self._set(revision, Readiness.WARMING)
        restarts = self.backend.restarts

        def engine_lost() -> bool:
            return self.backend.problem() is not None or self.backend.restarts != restarts

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
            if engine_lost():  # not the revision's fault: admitted again once the engine is back
                raise EngineUnavailableError(f"the engine restarted under {revision}: {e}") from e
            raise
        with self._lock:
            # The engine may have died since the load (and `_engine_lost` run already): only
            # an engine that still holds what was loaded makes the revision ready. The backend
            # reports its problem before it tells the worker, so this check and `_engine_lost`
            # (both under the lock) cannot miss each other.
            if engine_lost():
                raise EngineUnavailableError(f"the engine restarted while {revision} warmed up")
            if not self.residency.in_host(key):  # another prewarm evicted it meanwhile
                self._set(revision, Readiness.NOT_ADMITTED, reason="evicted from host cache")
                return
            self._set(revision, Readiness.READY)

    def _fetch(self, uri: str) -> Path:
        if not getattr(self._prewarming, "active", False):
            with self._lock:
                self._request_path_fetches += 1
        return self.store.fetch(uri)

    def _evicted(self, key: str) -> None:
        """`key` left the host cache: it no longer serves here until admitted again."""
        self.backend.unload(key)
        with self._lock:
            for revision, entry in self._table.items():
                if str(revision) == key and entry.state is Readiness.READY:
                    self._set(revision, Readiness.NOT_ADMITTED, reason="evicted from host cache")


def _alias_of(move: HeldMove) -> tuple[str, str]:
    return move.adapter, move.alias
