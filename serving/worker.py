"""A serving worker: the resident engine, its scheduler, the residency tiers and each
revision's readiness on this worker.

Revisions reach the engine only through admission: `admit` queues a revision, and one
background thread prewarms queued revisions one at a time, in two phases: fetch and verify the
artifact into the host cache (`fetching`), then load it into a device slot and run a warm-up
generation through the scheduler (`warming`); only then is it `ready`. The request path never
fetches anything: `route` answers with the engine key of a ready revision or raises
`RevisionNotReady` at once.
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
from mint_core.residency import Residency
from mint_core.revisions import PRODUCTION, PolicyRecord, RevisionId, RevisionRef
from mint_core.states import Readiness, transition
from serving.engine import BASE, AdapterWeights, TorchEngine
from serving.metrics import WorkerMetrics
from serving.sampling import SamplingParams
from serving.scheduler import DEFAULT_MAX_BATCH, Request, Scheduler

log = logging.getLogger(__name__)

WARMUP_PROMPT = "warm="
WARMUP_TIMEOUT_S = 120.0
DEFAULT_HOST_CACHE_BYTES = 1 << 30


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

    def __init__(
        self,
        engine: TorchEngine,
        registry: Registry,
        store: ArtifactStore,
        host_cache_bytes: int = DEFAULT_HOST_CACHE_BYTES,
        max_batch: int = DEFAULT_MAX_BATCH,
    ) -> None:
        self.engine = engine
        self.registry = registry
        self.store = store
        self.residency = Residency(host_cache_bytes, engine.slots)
        self.metrics = WorkerMetrics(self.residency)
        self._host: dict[str, AdapterWeights] = {}
        """The host cache's contents (the residency plan says what belongs here)."""
        self.scheduler = Scheduler(engine, self.residency, self._host.__getitem__,
                                   self.metrics, max_batch)  # fmt: skip
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
            if state not in (Readiness.NOT_ADMITTED, Readiness.FAILED):
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
            self.metrics.not_ready.inc()
            raise RevisionNotReady(entry)
        return revision, str(revision)

    def generate(self, prompt: str, key: str, params: SamplingParams) -> Request:
        """Queue a generation for a routed engine key; iterate the request for its tokens."""
        return self.scheduler.submit(self.engine.tokenizer.encode(prompt), key, params)

    def close(self) -> None:
        self.scheduler.stop()

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
            try:
                self._prewarm(revision)
            except MintError as e:
                log.warning("prewarm of %s failed: %s", revision, e)
                self._fail(revision, str(e))
            except Exception as e:  # a worker must outlive any one bad revision
                log.exception("prewarm of %s crashed", revision)
                self._fail(revision, f"{type(e).__name__}: {e}")

    def _fail(self, revision: RevisionId, reason: str) -> None:
        key = str(revision)
        if self.residency.drop_host(key):
            self._host.pop(key, None)
            self.engine.unload(key)
        with self._lock:
            self._set(revision, Readiness.FAILED, reason=reason)

    def _prewarm(self, revision: RevisionId) -> None:
        with self._lock:
            self._set(revision, Readiness.FETCHING)
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
        key = str(revision)
        weights = self.engine.prepare(key, index.adapter_config, adapter.peft_state_dict())
        self._host[key] = weights
        for evicted in self.residency.put_host(key, weights.nbytes):
            self._evicted(evicted)

        with self._lock:
            self._policies[revision] = registered.policy
            self._set(revision, Readiness.WARMING)
        warm_up = SamplingParams(max_new_tokens=2)
        self.generate(WARMUP_PROMPT, key, warm_up).result(timeout_s=WARMUP_TIMEOUT_S)
        with self._lock:
            self._set(revision, Readiness.READY)

    def _evicted(self, key: str) -> None:
        """`key` left the host cache: it no longer serves here until admitted again."""
        self._host.pop(key, None)
        self.engine.unload(key)
        with self._lock:
            for revision, entry in self._table.items():
                if str(revision) == key and entry.state is Readiness.READY:
                    self._set(revision, Readiness.NOT_ADMITTED, reason="evicted from host cache")
