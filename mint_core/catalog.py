"""A worker's copy of what the registry says: which revision each alias names, each revision's
record, and so which revisions the worker should hold.

The registry (MLflow) is the source of truth; the catalog follows it by `sync`, which asks only
for adapters changed since the last sync (by the registry's last-updated time). Requests
resolve aliases here, not in MLflow, so serving neither waits on MLflow nor stops when it is
down: the catalog keeps the last state it saw and says how old it is. While the last sync
failed, a name the catalog has not seen is refused at once (RegistryError) instead of being
asked of a registry that is known not to answer, which would hold the request for as long as
MLflow's client retries.
"""

import threading
import time
from collections.abc import Iterable

from mint_core.errors import RegistryError
from mint_core.registry import RegisteredRevision, Registry
from mint_core.revisions import CANDIDATE, PRODUCTION, RevisionId, RevisionRef

DESIRED_ALIASES = (PRODUCTION, CANDIDATE)
_OVERLAP_MS = 2000
"""Each sync asks again for this much of the time before the last change it saw: two changes
in one millisecond, or a commit that lands late, are not missed. Seeing one twice is harmless."""


class Catalog:
    def __init__(
        self, registry: Registry, pins: Iterable[RevisionId] = (), base_digest: str | None = None
    ) -> None:
        self.registry = registry
        self.pins = frozenset(pins)
        """Revisions configured to be held whatever the aliases say."""
        self.base_digest = base_digest
        """The serving base: adapters of other bases are addressable but never desired here
        (their workers hold them). None: every adapter's."""
        self._aliases: dict[str, dict[str, int]] = {}
        self._bases: dict[str, str] = {}
        self._records: dict[RevisionId, RegisteredRevision] = {}
        self._cursor_ms = 0
        self._lock = threading.Lock()
        self.last_sync: float | None = None
        """Unix time of the last successful sync."""
        self.unreachable: str | None = None
        """Why the last sync failed; None once one succeeds."""

    def sync(self) -> list[str]:
        """Catch up with the registry; the adapters that changed. RegistryError if it is down
        (the catalog keeps what it had)."""
        try:
            changed = self.registry.adapters_changed_since(max(0, self._cursor_ms - _OVERLAP_MS))
        except RegistryError as e:
            self.unreachable = str(e)
            raise
        with self._lock:
            for adapter in changed:
                self._aliases[adapter.adapter] = dict(adapter.aliases)
                self._bases[adapter.adapter] = adapter.base_digest
                self._cursor_ms = max(self._cursor_ms, adapter.updated_ms)
            self.last_sync = time.time()
            self.unreachable = None
        return [adapter.adapter for adapter in changed]

    def _ask_registry(self, name: RevisionRef | RevisionId | str) -> Registry:
        """The registry, to look up `name`, which this catalog has not seen; RegistryError at
        once if the last sync found the registry down."""
        if self.unreachable is not None:
            raise RegistryError(
                f"{name} is not in this worker's catalog and the registry cannot be asked now: "
                f"{self.unreachable}; try again once it answers"
            )
        return self.registry

    def desired(self) -> set[RevisionId]:
        """What this worker should hold: the `production` and `candidate` revisions of every
        adapter on its base, and the pins."""
        with self._lock:
            named = {
                RevisionId(adapter, number)
                for adapter, aliases in self._aliases.items()
                for alias, number in aliases.items()
                if alias in DESIRED_ALIASES
                and self.base_digest in (None, self._bases.get(adapter) or self.base_digest)
            }
        return named | self.pins

    def alias_target(self, adapter: str, alias: str) -> int | None:
        with self._lock:
            return self._aliases.get(adapter, {}).get(alias)

    def resolve(self, ref: RevisionRef) -> RegisteredRevision:
        """The revision `ref` names, from the catalog when it knows; asks the registry only for
        what it has not seen (NotFoundError, or RegistryError if MLflow is down)."""
        if ref.revision is not None:
            return self.record(RevisionId(ref.adapter, ref.revision))
        number = self.alias_target(ref.adapter, str(ref.alias))
        if number is None:
            registered = self._ask_registry(ref).resolve(ref)
            with self._lock:
                self._records[registered.id] = registered
            return registered
        return self.record(RevisionId(ref.adapter, number))

    def record(self, revision: RevisionId) -> RegisteredRevision:
        """A revision's registry record, fetched once: a revision's bytes and policy never
        change (its stage and aliases in the copy kept here may be old)."""
        with self._lock:
            known = self._records.get(revision)
        if known is not None:
            return known
        registered = self._ask_registry(revision).get(revision)
        with self._lock:
            self._records[revision] = registered
        return registered

    def adapters(self) -> list[str]:
        with self._lock:
            return sorted(self._aliases)

    def knows(self, adapter: str) -> bool:
        """Whether `adapter` is registered (asking the registry if not synced yet)."""
        with self._lock:
            if adapter in self._aliases:
                return True
        return self._ask_registry(f"adapter {adapter!r}").has_adapter(adapter)
