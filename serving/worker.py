"""A serving worker: the resident engine plus each revision's readiness on this worker.

Revisions reach the engine only through admission: `admit` queues a revision, and one
background thread prewarms queued revisions one at a time (fetch, verify, load, warm-up
forward) before marking them ready. The request path never loads anything: `route` answers
with the engine key of a ready revision or raises `RevisionNotReady` at once.
"""

import logging
import queue
import threading
import time
from dataclasses import dataclass

from mint_core.access import ANONYMOUS, allows, check_access
from mint_core.artifact_store import ArtifactStore
from mint_core.errors import (
    BaseMismatchError,
    IntegrityError,
    MintError,
    NotFoundError,
    NotReadyError,
)
from mint_core.packing import load as load_packed
from mint_core.registry import Registry
from mint_core.revisions import PRODUCTION, PolicyRecord, RevisionId, RevisionRef
from mint_core.states import Readiness, transition
from serving.engine import BASE, TorchEngine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReadinessEntry:
    """One revision's state on this worker."""

    revision: RevisionId
    state: Readiness
    since: float
    """Unix time the revision entered `state`."""
    reason: str | None = None
    """Why it failed, for `failed`."""


class RevisionNotReady(NotReadyError):
    def __init__(self, entry: ReadinessEntry) -> None:
        super().__init__(f"{entry.revision} is {entry.state} on this worker, not ready")
        self.entry = entry


class Worker:
    """Readiness table, admission queue and prewarm loop around one engine."""

    def __init__(self, engine: TorchEngine, registry: Registry, store: ArtifactStore) -> None:
        self.engine = engine
        self.registry = registry
        self.store = store
        self._table: dict[RevisionId, ReadinessEntry] = {}
        self._policies: dict[RevisionId, PolicyRecord] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue[RevisionId] = queue.Queue()
        self._prewarmer = threading.Thread(target=self._prewarm_loop, name="prewarm", daemon=True)
        self._prewarmer.start()

    def readiness(self, revision: RevisionId) -> ReadinessEntry:
        with self._lock:
            entry = self._table.get(revision)
        return entry or ReadinessEntry(revision, Readiness.NOT_ADMITTED, since=0.0)

    def entries(self, adapter: str) -> list[ReadinessEntry]:
        with self._lock:
            found = [e for r, e in self._table.items() if r.adapter == adapter]
        return sorted(found, key=lambda e: e.revision.number)

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

    def admit(self, revision: RevisionId) -> ReadinessEntry:
        """Queue `revision` for prewarm. Idempotent: a queued, prewarming or ready revision
        stays as it is."""
        with self._lock:
            current = self._table.get(revision)
            state = current.state if current else Readiness.NOT_ADMITTED
            if state in (Readiness.QUEUED, Readiness.PREWARMING, Readiness.READY):
                return current  # type: ignore[return-value]
            entry = self._set(revision, Readiness.QUEUED)
        self._queue.put(revision)
        return entry

    def reconcile(self) -> list[RevisionId]:
        """Admit what the registry says users get: every adapter's `production` revision."""
        admitted = []
        for adapter in self.registry.adapters():
            try:
                revision = self.registry.resolve(RevisionRef(adapter, alias=PRODUCTION)).id
            except NotFoundError:
                continue
            self.admit(revision)
            admitted.append(revision)
        return admitted

    def route(
        self, ref: RevisionRef | None, principal: str = ANONYMOUS
    ) -> tuple[RevisionId | None, str]:
        """The revision `ref` names and its engine key, if `principal` may use it and it is
        ready here; never loads. NotFoundError for an unknown adapter or revision,
        AccessDeniedError, or RevisionNotReady."""
        if ref is None:
            return None, BASE
        registered = self.registry.resolve(ref)
        revision = registered.id
        check_access(registered.policy, principal, revision)
        entry = self.readiness(revision)
        if entry.state is not Readiness.READY:
            raise RevisionNotReady(entry)
        return revision, str(revision)

    def _set(
        self, revision: RevisionId, state: Readiness, reason: str | None = None
    ) -> ReadinessEntry:
        current = self._table.get(revision)
        transition(current.state if current else Readiness.NOT_ADMITTED, state)
        entry = ReadinessEntry(revision, state, since=time.time(), reason=reason)
        self._table[revision] = entry
        return entry

    def _prewarm_loop(self) -> None:
        while True:
            revision = self._queue.get()
            with self._lock:
                self._set(revision, Readiness.PREWARMING)
            try:
                self._prewarm(revision)
            except MintError as e:
                log.warning("prewarm of %s failed: %s", revision, e)
                with self._lock:
                    self._set(revision, Readiness.FAILED, reason=str(e))
            except Exception as e:  # a worker must outlive any one bad revision
                log.exception("prewarm of %s crashed", revision)
                with self._lock:
                    self._set(revision, Readiness.FAILED, reason=f"{type(e).__name__}: {e}")
            else:
                with self._lock:
                    self._set(revision, Readiness.READY)

    def _prewarm(self, revision: RevisionId) -> None:
        registered = self.registry.get(revision)
        if registered.policy.base_digest != self.engine.base.digest:
            raise BaseMismatchError(
                f"{revision} was trained on base {registered.policy.base_digest}; this worker "
                f"serves {self.engine.base.digest}"
            )
        adapter = load_packed(self.store.fetch(registered.artifact_uri))
        index = adapter.index
        if index.content_digest != registered.policy.content_digest:
            raise IntegrityError(
                f"artifact of {revision} has content digest {index.content_digest}, the policy "
                f"record says {registered.policy.content_digest}"
            )
        self.engine.load(str(revision), index.adapter_config, adapter.peft_state_dict())
        self.engine.warm_up(str(revision))
        with self._lock:
            self._policies[revision] = registered.policy
