"""Prewarm: K threads take admitted revisions from the readiness table one at a time and make
each ready in two phases: fetch and verify the artifact into the host tier (`fetching`), then
load it into the engine and run a warm-up generation (`warming`); only then is it `ready`.

- Supervised: whatever goes wrong with one revision, its own error handling included, is
  logged and the thread goes on to the next (a dead prewarm thread would leave admitted
  revisions queued for good).
- Engine generations: a revision becomes ready only if the engine it warmed up on is not
  known lost (`ReadinessTable.make_ready` checks it against `engine_lost`, under one lock).
- A revision evicted from the host tier, or held by an engine that died, goes back to not
  admitted; the watcher admits it again if the registry still wants it.
"""

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from mint_core.artifacts.packing import load as load_packed
from mint_core.artifacts.stores import ArtifactStore
from mint_core.catalog.catalog import Catalog
from mint_core.errors import EngineUnavailableError, IntegrityError, MintError, NotFoundError
from mint_core.planning.admission import Priority
from mint_core.planning.residency import HostTierFull
from mint_core.revisions import PolicyRecord, RevisionId
from mint_core.states import Readiness
from serving.backends.protocol import Backend
from serving.engine.generation import Generating
from serving.engine.sampling import SamplingParams
from serving.worker.readiness import ReadinessTable

log = logging.getLogger(__name__)

WARMUP_TEXT = "H"
"""A neutral prompt for the warm-up generation, in the base's own tokens (whatever the base):
one character, one token on any tokenizer (two with a BOS), since its forward pass costs
arithmetic per prompt token and proves nothing more for a longer prompt."""
WARMUP_TOKENS = 1
"""One token: the prefill that makes it runs every layer through the adapter's slot and samples
from its logits, which is what the warm-up must prove; each further token is one more full
forward pass (a whole read of the base's weights) that proves nothing more."""
WARMUP_TIMEOUT_S = 120.0
PREWARM_NICENESS = 10
_LOADED = frozenset({Readiness.FETCHING, Readiness.WARMING, Readiness.READY})
"""States in which a revision holds weights on this worker."""


class Prewarm:
    """The prewarm work of one worker; `run` is the body of each of its K threads."""

    def __init__(
        self,
        backend: Backend,
        catalog: Catalog,
        store: ArtifactStore,
        readiness: ReadinessTable,
        check_base: Callable[[PolicyRecord, RevisionId], None],
        closed: threading.Event,
        nudge: Callable[[], None],
    ) -> None:
        self.backend = backend
        self.catalog = catalog
        self.store = store
        self.readiness = readiness
        self.check_base = check_base
        """BaseMismatchError unless a revision was trained on this worker's base."""
        self.closed = closed
        self.nudge = nudge
        """Asks the watcher to sync now: once an engine is back, to admit what it lost."""
        self._lock = threading.Lock()
        """Guards `_request_path_fetches`."""
        self._request_path_fetches = 0
        self._prewarming = threading.local()
        """`active` is set on prewarm threads: their fetches are not on the request path."""

    @property
    def request_path_fetches(self) -> int:
        """Fetches from the artifact store made outside a prewarm thread."""
        with self._lock:
            return self._request_path_fetches

    def run(self) -> None:
        """One prewarm thread: the next admitted revision, prewarmed, until the worker closes."""
        # Prewarming is background work: on a busy machine the running batch goes first.
        with contextlib.suppress(AttributeError, OSError):  # per-thread nice: Linux only
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PREWARM_NICENESS)
        self._prewarming.active = True
        while (revision := self.readiness.next_admitted(self.closed)) is not None:
            try:
                self.prewarm_or_fail(revision)
            except Exception:
                log.exception("prewarm of %s ended in an error of its own handling", revision)
            finally:
                self.readiness.finish(revision)

    def prewarm_or_fail(self, revision: RevisionId) -> None:
        """Prewarm `revision`; if that fails, record why (failed, or dropped when the engine
        or a full host tier is to blame)."""
        started = time.monotonic()
        try:
            self._prewarm(revision)
            self.readiness.prewarmed(time.monotonic() - started)
        except HostTierFull as e:
            # Not the revision's fault: admitted again when demand or the registry asks.
            log.warning("prewarm of %s put off: %s", revision, e)
            self._drop(revision, str(e))
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

    def engine_lost(self, generation: int) -> None:
        """The engine of `generation` died with every adapter it held: nothing is ready until
        prewarmed again (the watcher admits what the registry wants once the engine is
        back), and nothing warmed on that engine becomes ready (`ReadinessTable.make_ready`)."""
        for revision in self.readiness.engine_lost(generation):
            self._drop(revision, "the engine restarted")
        self.nudge()

    def _fail(self, revision: RevisionId, reason: str) -> None:
        self.backend.unload(str(revision))
        self.readiness.move(revision, Readiness.FAILED, reason=reason)

    def _drop(self, revision: RevisionId, reason: str) -> None:
        """`revision` no longer serves here (evicted, or the engine lost it) until admitted
        again; the watcher admits it again if the registry still wants it."""
        self.backend.unload(str(revision))
        self.readiness.move(revision, Readiness.NOT_ADMITTED, reason=reason, only_from=_LOADED)

    def _prewarm(self, revision: RevisionId) -> None:
        self.readiness.move(revision, Readiness.FETCHING)
        registered = self.catalog.record(revision)
        self.check_base(registered.policy, revision)
        try:
            adapter = load_packed(self.fetch(registered.artifact_uri))
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

        self.readiness.warming(revision, registered.policy)
        generation = self.backend.generation
        generating: Generating | None = None
        try:
            self.backend.load(key)
            prompt = self.backend.text.codec.encode(WARMUP_TEXT)
            warm_up = SamplingParams(max_new_tokens=WARMUP_TOKENS)
            generating = self.backend.submit(prompt, key, warm_up, warm_up=True, streamed=False)
            generating.result(timeout_s=WARMUP_TIMEOUT_S)
        except MintError as e:
            if generating is not None:
                # A warm-up that timed out still runs, pinning its slot: the weights leave
                # (`_fail`, `_drop`) once it stops, which this makes the next step.
                generating.cancel()
            engine_down = self.backend.problem() is not None
            if engine_down or self.readiness.engine_lost_since(generation):
                # Not the revision's fault: admitted again once the engine is back.
                raise EngineUnavailableError(f"the engine restarted under {revision}: {e}") from e
            raise
        # Ready only if the engine it warmed on still runs: checked against `engine_lost`.
        residency = self.backend.residency
        self.readiness.make_ready(revision, generation, lambda: residency.in_host(key))
        # Warmed: from now on the host tier may evict it; a prefill at once, as no request
        # waits for it.
        residency.settle(key, fresh=self.readiness.started_as(revision) is not Priority.PREFILL)

    def fetch(self, uri: str) -> Path:
        """A local folder holding the artifact at `uri`; counted as a request-path fetch
        unless a prewarm thread makes it (the readiness gate never does)."""
        if not getattr(self._prewarming, "active", False):
            with self._lock:
                self._request_path_fetches += 1
        return self.store.fetch(uri)

    def _evicted(self, key: str) -> None:
        """`key` left the host cache: it no longer serves here until admitted again."""
        self.backend.unload(key)
        for revision in self.readiness.ready():
            if str(revision) == key:
                self.readiness.move(
                    revision,
                    Readiness.NOT_ADMITTED,
                    reason="evicted from host cache",
                    only_from=frozenset({Readiness.READY}),
                )
