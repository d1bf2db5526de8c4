"""A worker's copy of what the registry says: which revision each alias names, each revision's
record, and so which revisions the worker should hold.

The registry (MLflow) is the source of truth; the catalog follows it by `sync` (only adapters
changed since the last one). Requests resolve aliases here, not in MLflow, so serving neither
waits on MLflow nor stops when it is down. What it holds lives in a sqlite index
(`catalog.index`), with recent answers kept as objects (`catalog.hot`), a worker starts from the
published snapshot (`build_snapshot`, `start_from_snapshot`), and reads of the registry are
shared (`catalog.flights`) or spared (`catalog.absent`): how, and what a caller is told while
MLflow is down: the README, "Running the pieces".
"""

import logging
import os
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from mint_core.alias_intents import HeldMove
from mint_core.artifacts.stores import ArtifactStore
from mint_core.catalog import snapshot as catalog_snapshot
from mint_core.catalog.absent import Absent
from mint_core.catalog.flights import Flights
from mint_core.catalog.hot import HotMap
from mint_core.catalog.index import CatalogIndex
from mint_core.catalog.snapshot import Snapshot
from mint_core.config import DEFAULT_CATALOG_SNAPSHOTS
from mint_core.errors import IntegrityError, NotFoundError, RegistryError, ServiceError
from mint_core.registry import AdapterAliases, RegisteredRevision
from mint_core.revisions import CANARY, CANDIDATE, PRODUCTION, RevisionId, RevisionRef
from mint_core.states import Stage

log = logging.getLogger(__name__)
T = TypeVar("T")

ROLLOUT_ALIASES = (CANDIDATE, CANARY)
"""Aliases on revisions being rolled out: their placement takes them in whatever else it holds."""
SERVED_ALIASES = (PRODUCTION, *ROLLOUT_ALIASES)
"""Aliases whose revisions the fleet serves."""
_OVERLAP_MS = 2000
"""Each sync asks again for this much of the time before the last change it saw: two changes
in one millisecond, or a commit that lands late, are not missed. One seen again unchanged is
not counted as a change (`CatalogIndex.put_adapters`)."""
INDEX_PREFIX = "mint-catalog-"
"""How a catalog's index file is named in its folder: then the pid of its process."""
DEFAULT_AUDIT_INTERVAL_S = 30.0
"""How often a catalog reads every adapter's aliases, changed or not: an alias moved by hand
(the MLflow UI) does not change the adapter's last-updated time, so only a full read finds
it (one request per thousand adapters)."""
HOT_ANSWERS = 32768
"""Answers (records by revision or by alias, canaries) kept as objects: the revisions a worker
serves, without a lookup in the index each time. A record takes about 2 KB, so at most ~70 MB
(an answer by alias shares its revision's record)."""


class RevisionReader(Protocol):
    """What a catalog reads of revisions (`mint_core.registry.Revisions` is one)."""

    def get(self, revision: RevisionId) -> RegisteredRevision:
        """The record of `revision`; NotFoundError if it is not registered."""

    def resolve(self, ref: RevisionRef) -> RegisteredRevision:
        """The revision `ref` names now; NotFoundError names what is missing."""

    def has_adapter(self, adapter: str) -> bool:
        """Whether `adapter` is registered (one request, where resolving a name costs more)."""

    def pages(self) -> Iterable[list[RegisteredRevision]]:
        """Every revision of every adapter, a page at a time."""


class ChangeReader(Protocol):
    """What a catalog reads of the registry's changes (`mint_core.registry.Changes` is one)."""

    def since(self, since_ms: int) -> list[AdapterAliases]:
        """Every adapter updated at or after `since_ms` on the registry's clock."""


class RegistryReader(Protocol):
    """What a catalog reads of the registry (`mint_core.registry.Registry` is one), through
    two of its parts: a catalog never writes to it."""

    @property
    def revisions(self) -> RevisionReader: ...

    @property
    def changes(self) -> ChangeReader: ...


@dataclass(frozen=True)
class ServingTargets:
    """What the registry wants served on one base (`Catalog.serving_targets`)."""

    rollout: frozenset[RevisionId]
    """`candidate` and `canary` revisions: their placement takes them in."""
    production: frozenset[RevisionId]
    """`production` revisions: their placement takes them in while it has room; the rest
    come by demand."""
    pins: frozenset[RevisionId]
    """Held by every worker whatever the aliases say."""


class Catalog:
    def __init__(
        self,
        registry: RegistryReader,
        pins: Iterable[RevisionId] = (),
        base_digest: str | None = None,
        folder: Path | None = None,
        audit_interval_s: float = DEFAULT_AUDIT_INTERVAL_S,
    ) -> None:
        self.registry = registry
        self.audit_interval_s = audit_interval_s
        """Seconds between full reads of every adapter's aliases (see DEFAULT_AUDIT_INTERVAL_S)."""
        self._last_audit = time.monotonic()
        """`time.monotonic()` of the last full read (a new catalog starts from a snapshot or
        reads everything: its first sync needs none)."""
        self.pins = frozenset(pins)
        """Revisions configured to be held whatever the aliases say."""
        self.base_digest = base_digest
        """The serving base: adapters of other bases are addressable but never desired here
        (their workers hold them). None: every adapter's."""
        folder = Path(tempfile.gettempdir()) if folder is None else folder
        folder.mkdir(parents=True, exist_ok=True)
        # The index file is this catalog's alone (a worker's is a copy of the snapshot, then
        # kept current), made in `folder` (else the system's temporary folder) and removed
        # when the catalog closes or is collected. A process killed outright removes nothing:
        # its files carry its pid, and the next catalog made in the folder removes them.
        sweep_indexes(folder)
        prefix = f"{INDEX_PREFIX}{os.getpid()}-"
        handle, name = tempfile.mkstemp(prefix=prefix, suffix=".sqlite", dir=folder)
        os.close(handle)
        self._index = CatalogIndex(Path(name))
        self._close = weakref.finalize(self, _close_index, self._index)
        self._hot: HotMap[object] = HotMap(HOT_ANSWERS)
        """Recent answers, read without a lock (see `catalog.hot`)."""
        self._changes = 0
        """How many times what the index holds has changed: `serving_targets()`'s answer is
        kept until it does (or the base is changed)."""
        self._serving_targets: tuple[tuple[int, str | None], ServingTargets] | None = None
        self._replicas: tuple[int, dict[str, int]] = (-1, {})
        """Adapters whose gates set their replicas, as of a count of `_changes`."""
        self._lock = threading.Lock()
        self._flights: Flights[object] = Flights()
        """Registry reads in flight, by the name asked about (see `_from_registry`)."""
        self._absent = Absent()
        """Names the registry said it does not have, until the next sync (`catalog.absent`)."""
        self.lookups = 0
        """How many times a name this catalog had not seen was asked of the registry."""
        self.snapshot: Snapshot | None = None
        """The snapshot this catalog started from, if any."""
        self.last_sync: float | None = None
        """Unix time of the last successful sync."""
        self.unreachable: str | None = None
        """Why the last sync failed; None once one succeeds."""

    @property
    def index_path(self) -> Path:
        """The index file: sqlite, `catalog.index`'s layout."""
        return self._index.path

    def close(self) -> None:
        """Close and remove the index. Idempotent."""
        self._close()

    def start_from_snapshot(self, store: ArtifactStore) -> Snapshot | None:
        """At a worker's start: hold the current snapshot in `store` in place of everything
        this catalog holds; the next sync goes on from its cursor. None if there is no snapshot
        or it is damaged or out of reach (a warning says why): the catalog then follows the
        registry from what it holds, so a new one's first sync reads the whole registry."""
        staging = self._index.path.with_name(self._index.path.name + ".snapshot")
        try:
            snapshot = catalog_snapshot.fetch(store, staging)
            if snapshot is not None:
                self._index.replace_with(staging)
        except (IntegrityError, ServiceError) as e:
            log.warning("starting without a catalog snapshot, from the registry alone: %s", e)
            return None
        finally:
            staging.unlink(missing_ok=True)
        if snapshot is None:
            log.info("no catalog snapshot in the store; the first sync reads the whole registry")
            return None
        self._hot.invalidate()
        self._absent.clear()
        with self._lock:
            self._changes += 1
            self.snapshot = snapshot
        return snapshot

    def sync(self) -> list[str]:
        """Catch up with the registry; the adapters that changed. RegistryError if it is down
        (the catalog keeps what it had)."""
        audit = time.monotonic() - self._last_audit >= self.audit_interval_s
        try:
            changed = catch_up(self._index, self.registry, every_adapter=audit)
        except RegistryError as e:
            self.unreachable = str(e)
            raise
        if audit:
            self._last_audit = time.monotonic()
        if changed:
            # Committed to the index: no answer kept from before is given after this returns.
            self._hot.invalidate(adapter.adapter for adapter in changed)
            self._absent.forget(adapter.adapter for adapter in changed)  # registered now
            with self._lock:
                self._changes += 1
        self.last_sync = time.time()
        self.unreachable = None
        return [adapter.adapter for adapter in changed]

    @property
    def absent_answers(self) -> int:
        """How many times a name was answered "not found" from memory, not asked again."""
        return self._absent.answered

    def _from_registry(
        self, name: RevisionRef | RevisionId | str, adapter: str, read: Callable[[], T]
    ) -> T:
        """`read()`, which asks the registry about `name` (of `adapter`), which this catalog
        has not seen. A "not found" the registry gave recently about an adapter this catalog
        does not know is answered again at once (until a sync sees the adapter), unless the
        last sync found the registry down: then RegistryError at once. Concurrent asks about
        one name share one read (a restarted worker's burst asks MLflow once, not once per
        request), its answer or its error. A RegistryError says that the registry cannot
        answer, not what MLflow said or where it is: that goes to the log."""
        if self.unreachable is not None:
            raise RegistryError(_unavailable(name))
        self._absent.check(name)

        def asked() -> T:
            try:
                return read()
            except NotFoundError as e:
                # Only about adapters the index lacks: one it holds gets new revisions and
                # aliases that a request may name before a sync has seen them.
                if not self._index.knows(adapter):
                    self._absent.keep(name, adapter, e)
                raise
            except RegistryError as e:
                log.warning("the registry did not answer about %s: %s", name, e)
                raise RegistryError(_unavailable(name)) from None

        return self._flights.run(name, asked)  # type: ignore[arg-type,return-value]

    def _asking(self) -> None:
        """Count one question to the registry (`lookups`); under the flight's key, so one
        per name however many callers wait on it."""
        with self._lock:
            self.lookups += 1

    def serving_targets(self) -> ServingTargets:
        """What the registry wants served on this worker's base: the revisions being rolled
        out (`candidate`, `canary`), the `production` ones, and the pins. Asked every sync
        interval: the index is queried only after a sync brought changes."""
        with self._lock:
            key = (self._changes, self.base_digest)
            last = self._serving_targets
            cached = last[1] if last and last[0] == key else None
        if cached is None:
            cached = ServingTargets(
                rollout=frozenset(self._index.named(ROLLOUT_ALIASES, self.base_digest)),
                production=frozenset(self._index.named((PRODUCTION,), self.base_digest)),
                pins=self.pins,
            )
            with self._lock:
                self._serving_targets = (key, cached)  # a change meanwhile: `key` is already old
        return cached

    def desired(self) -> set[RevisionId]:
        """Every revision `serving_targets` names: production, candidate and canary revisions
        of this worker's base, and the pins."""
        targets = self.serving_targets()
        return set(targets.rollout | targets.production | targets.pins)

    def replicas(self, adapter: str) -> int:
        """How many workers hold each revision of `adapter`, as its gates say; 0: the fleet's
        setting. From memory: placement asks it for every revision at each sync."""
        with self._lock:
            cached = self._replicas if self._replicas[0] == self._changes else None
        if cached is None:
            cached = (self._changes, self._index.replicas_set())
            with self._lock:
                self._replicas = cached
        return cached[1].get(adapter, 0)

    def alias_target(self, adapter: str, alias: str) -> int | None:
        return self._index.alias_target(adapter, alias)

    def in_front_of_users(self, registered: RegisteredRevision) -> bool:
        """Whether users have been given `registered`: `production` or `canary` names it (as of
        the last sync), or it was active once (stage `active` or `retired`). Demand admission
        serves only these: a revision still in its roll-out is no user's yet."""
        if registered.stage in (Stage.ACTIVE, Stage.RETIRED):
            return True
        adapter, number = registered.id.adapter, registered.id.number
        return any(self.alias_target(adapter, alias) == number for alias in (PRODUCTION, CANARY))

    def held_moves(self) -> list[HeldMove]:
        """Aliases the registry points where the pipeline did not move them, as of the last
        sync: each is served at the pipeline's last target meanwhile."""
        return self._index.held_moves()

    def canary(self, adapter: str) -> tuple[RevisionId, float] | None:
        """The revision that takes a share of `adapter@production`'s requests, and the share
        in percent, as of the last sync; None when the adapter has no canary."""
        key = ("canary", adapter)  # keys are tuples: hashed in C (see `catalog.hot`)
        cached = self._hot.get(adapter, key)
        if cached is not None:  # asked for every request to adapter@production
            return cached[0]  # type: ignore[index,no-any-return]
        stamp = self._hot.stamp(adapter)
        found = self._index.canary(adapter)
        answer = None if found is None else (RevisionId(adapter, found[0]), found[1])
        self._hot.put(stamp, key, (answer,))  # kept even when None: the map keeps no None
        return answer

    def cached(self, ref: RevisionRef) -> RegisteredRevision | None:
        """What `resolve(ref)` answered recently, if it still holds; None when answering would
        read the index or the registry. Never blocks: an event loop asks this first and takes
        a thread only for what `resolve` has to read."""
        if ref.revision is not None:
            key: tuple[str, str, object] = ("r", ref.adapter, ref.revision)
        else:
            key = ("@", ref.adapter, ref.alias)
        return self._hot.get(ref.adapter, key)  # type: ignore[return-value]

    def resolve(self, ref: RevisionRef) -> RegisteredRevision:
        """The revision `ref` names, from the catalog when it knows; asks the registry only for
        what it has not seen (NotFoundError, or RegistryError if MLflow is down)."""
        cached = self.cached(ref)
        if cached is not None:
            return cached
        if ref.revision is not None:
            return self.record(RevisionId(ref.adapter, ref.revision))
        stamp = self._hot.stamp(ref.adapter)  # before the index is read: see `catalog.hot`
        number = self.alias_target(ref.adapter, str(ref.alias))
        if number is None:
            for held in self._index.held_moves(ref.adapter):
                if held.alias == ref.alias:  # set outside the pipeline, never by it
                    raise NotFoundError(f"{held.describe()}; nothing serves {ref} here")

            # Kept by alias too, as the registry answered, until a sync changes the adapter
            # (which drops its kept answers): a burst's stragglers, which found no read in
            # flight, are answered from memory rather than asking MLflow again.
            def read() -> RegisteredRevision:
                cached = self.cached(ref)  # by a read that ended after this caller's first look
                if cached is not None:
                    return cached
                self._asking()
                found = self.registry.revisions.resolve(ref)
                self._index.put_revisions([found])
                self._hot.put(stamp, ("r", ref.adapter, found.id.number), found)
                self._hot.put(stamp, ("@", ref.adapter, ref.alias), found)
                return found

            self._check_registered(ref.adapter)
            return self._from_registry(ref, ref.adapter, read)
        registered = self.record(RevisionId(ref.adapter, number))
        self._hot.put(stamp, ("@", ref.adapter, ref.alias), registered)
        return registered

    def record(self, revision: RevisionId) -> RegisteredRevision:
        """A revision's registry record, fetched once: a revision's bytes and policy never
        change (its stage in the copy kept here may be old, and the index keeps no history
        tags: `mint history` reads those from the registry)."""
        key = ("r", revision.adapter, revision.number)
        cached = self._hot.get(revision.adapter, key)
        if cached is not None:
            return cached  # type: ignore[return-value]
        stamp = self._hot.stamp(revision.adapter)
        known = self._index.revision(revision)
        if known is None:

            def read() -> RegisteredRevision:
                indexed = self._index.revision(revision)  # by a read that ended meanwhile
                if indexed is not None:
                    return indexed
                self._asking()
                found = self.registry.revisions.get(revision)
                self._index.put_revisions([found])
                return found

            self._check_registered(revision.adapter)
            known = self._from_registry(revision, revision.adapter, read)
        self._hot.put(stamp, key, known)
        return known

    def adapters(self) -> list[str]:
        return self._index.adapters()

    def _check_registered(self, adapter: str) -> None:
        """NotFoundError if the registry does not have `adapter`: asked first, once for all
        of an adapter's revisions and aliases (`knows`), once the index holds the registry as
        of some time: then most names it lacks are no adapter at all (one request to MLflow,
        where resolving one costs two or more). Before that (a restarted worker's first
        requests), resolving is asked at once: the adapter is most likely registered."""
        if self._index.cursor_ms > 0 and not self.knows(adapter):
            raise NotFoundError(f"adapter {adapter!r} is not registered")

    def knows(self, adapter: str) -> bool:
        """Whether `adapter` is registered (asking the registry if not synced yet)."""
        if self._index.knows(adapter):
            return True

        def read() -> bool:
            self._asking()
            if not self.registry.revisions.has_adapter(adapter):
                raise NotFoundError(f"adapter {adapter!r} is not registered")
            return True

        try:
            return self._from_registry(f"adapter {adapter!r}", adapter, read)
        except NotFoundError:
            return False


def _unavailable(name: object) -> str:
    return (
        f"{name} is not in this worker's catalog and the registry is unavailable; try again shortly"
    )


def sweep_indexes(folder: Path) -> list[Path]:
    """Remove the files (index, its journals, its snapshot copies) of catalogs in `folder`
    whose process has exited; the files removed. A pid that runs again is left alone."""
    removed = []
    for path in folder.glob(f"{INDEX_PREFIX}*"):
        pid = path.name.removeprefix(INDEX_PREFIX).partition("-")[0]
        if pid.isdigit() and not _runs(int(pid)):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def catch_up(
    index: CatalogIndex, registry: RegistryReader, every_adapter: bool = False
) -> list[AdapterAliases]:
    """Write into `index` what changed in `registry` since its cursor (everything, every
    revision included, when it holds nothing yet; with `every_adapter`, every adapter's
    aliases are read); the adapters whose aliases, canary, replicas or base changed."""
    cursor = index.cursor_ms
    since = 0 if every_adapter else max(0, cursor - _OVERLAP_MS)
    reported = registry.changes.since(since)
    if cursor == 0:
        for page in registry.revisions.pages():
            index.put_revisions(page)
    return index.put_adapters(reported)  # last: the cursor moves once the revisions are in


def build_snapshot(
    registry: RegistryReader,
    store: ArtifactStore,
    folder: Path,
    keep: int = DEFAULT_CATALOG_SNAPSHOTS,
) -> Snapshot:
    """Read the whole registry into a new index under `folder` and publish it as the current
    catalog snapshot in `store`, keeping the newest `keep` (what `mint catalog snapshot`
    runs)."""
    folder.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix="catalog-", suffix=".sqlite", dir=folder)
    os.close(handle)
    path = Path(name)
    index = CatalogIndex(path)
    try:
        catch_up(index, registry)
        index.seal()
        index.close()
        return catalog_snapshot.publish(store, path, keep)
    finally:
        _close_index(index)


def _close_index(index: CatalogIndex) -> None:
    index.close()
    for suffix in ("", "-wal", "-shm"):
        Path(f"{index.path}{suffix}").unlink(missing_ok=True)
