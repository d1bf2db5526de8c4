"""The catalog's index: what the registry says, in one sqlite file rather than Python objects.

One row per adapter (its base, last-updated time and canary share), per alias, and per revision
(its artifact, its policy record as compact JSON, its other tags). A lookup is a primary-key
search in a B-tree: fast at a million revisions, and the memory it takes is sqlite's page cache
(bounded here), not an object per revision. The same file is the catalog snapshot the control plane
publishes (`catalog.snapshot`): a worker starts from a copy of it and keeps it current.

Workers look revisions up from many threads: one connection, used under a lock (a lookup holds
it for microseconds; sqlite's own cache then serves every thread).
"""

import json
import os
import sqlite3
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from mint_core.alias_intents import HeldMove
from mint_core.errors import IntegrityError
from mint_core.registry import (
    ALIAS_MOVE_TAG,
    STAGE_HISTORY_TAG,
    AdapterAliases,
    RegisteredRevision,
)
from mint_core.revisions import CANARY, TAG_PREFIX, PolicyRecord, RevisionId

FORMAT = 4
"""The index's layout; a file of another format is refused (rebuild the snapshot). 2: adapters
carry their canary share; 3: aliases are the ones the pipeline moved, and the held moves are
kept beside them (`mint_core.alias_intents`); 4: adapters carry their replicas. A worker
refusing an older snapshot reads the registry instead."""
CACHE_KIB = 16 << 10
"""sqlite's page cache per index: what its memory is bounded by, whatever it indexes."""
_POLICY_TAGS = frozenset(TAG_PREFIX + spec.name for spec in fields(PolicyRecord))

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS adapters (
    name TEXT PRIMARY KEY,
    base TEXT NOT NULL,
    updated_ms INTEGER NOT NULL,
    canary_percent REAL,
    replicas INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS adapters_by_base ON adapters (base);
CREATE TABLE IF NOT EXISTS aliases (
    adapter TEXT NOT NULL,
    alias TEXT NOT NULL,
    number INTEGER NOT NULL,
    PRIMARY KEY (adapter, alias)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS held_moves (
    adapter TEXT NOT NULL,
    alias TEXT NOT NULL,
    registry_number INTEGER,
    serving_number INTEGER,
    PRIMARY KEY (adapter, alias)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS revisions (
    adapter TEXT NOT NULL,
    number INTEGER NOT NULL,
    artifact_uri TEXT NOT NULL,
    policy TEXT NOT NULL,
    tags TEXT NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS revisions_by_id ON revisions (adapter, number);
"""
_REVISION = """
SELECT artifact_uri, policy, tags, (
    SELECT group_concat(alias) FROM aliases
    WHERE aliases.adapter = revisions.adapter AND aliases.number = revisions.number
) FROM revisions WHERE adapter = ? AND number = ?
"""
"""A revision's row and the aliases naming it, in one statement: a lookup is one call into
sqlite. (MLflow allows no commas in alias names.)"""
_CANARY = """
SELECT aliases.number, adapters.canary_percent FROM adapters JOIN aliases
ON aliases.adapter = adapters.name AND aliases.alias = ?
WHERE adapters.name = ? AND adapters.canary_percent IS NOT NULL
"""
# `revisions` keeps sqlite's rowid: its rows (~1 KB) are too large for a WITHOUT ROWID table
# to pay off, so a small unique index finds them.


class CatalogIndex:
    """The registry's adapters, aliases and revisions in the sqlite file at `path`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._db = self._open(path)

    @staticmethod
    def _open(path: Path) -> sqlite3.Connection:
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        try:
            db.execute(f"PRAGMA cache_size = -{CACHE_KIB}")
            # A worker's copy is rebuilt from the snapshot or the registry after a crash: it
            # needs no fsync. With WAL a sync's transaction appends the pages it changes to the
            # log instead of first copying each one to a rollback journal.
            db.execute("PRAGMA journal_mode = WAL")
            db.execute("PRAGMA synchronous = OFF")
            db.executescript(_SCHEMA)
            found = db.execute("SELECT value FROM meta WHERE key = 'format'").fetchone()
            if found is None:
                db.execute("INSERT INTO meta VALUES ('format', ?)", (str(FORMAT),))
            elif found[0] != str(FORMAT):
                raise IntegrityError(
                    f"catalog index {path} has format {found[0]}, this MinT reads {FORMAT}; "
                    "publish a new snapshot (mint catalog snapshot)"
                )
        except sqlite3.DatabaseError as e:
            db.close()
            raise IntegrityError(f"catalog index {path} is not a readable index: {e}") from e
        except IntegrityError:
            db.close()
            raise
        return db

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def replace_with(self, file: Path) -> None:
        """Hold what the index file `file` holds from now on, in place of all this index held:
        `file` is moved to this index's path. IntegrityError, and an empty index, if `file` is
        not an index of this format."""
        with self._lock:
            self._db.close()
            for suffix in ("-wal", "-shm"):
                Path(f"{self.path}{suffix}").unlink(missing_ok=True)
            os.replace(file, self.path)
            try:
                self._db = self._open(self.path)
            except IntegrityError:
                self.path.unlink()
                self._db = self._open(self.path)
                raise

    @property
    def cursor_ms(self) -> int:
        """The registry's last-updated time of the newest change this index holds; 0: none."""
        with self._lock:
            found = self._db.execute("SELECT value FROM meta WHERE key = 'cursor_ms'").fetchone()
        return int(found[0]) if found else 0

    def put_adapters(self, adapters: Sequence[AdapterAliases]) -> None:
        """These adapters' bases, aliases and canary shares as the registry has them now; moves
        the cursor to the newest of their last-updated times. The aliases kept are those the
        pipeline moved; the others are kept as held moves."""
        if not adapters:
            return
        newest = max(adapter.updated_ms for adapter in adapters)
        sanctioned = {a.adapter: a.sanctioned() for a in adapters}
        with self._lock, self._db:
            self._db.execute("BEGIN")
            self._db.executemany(
                "INSERT OR REPLACE INTO adapters VALUES (?, ?, ?, ?, ?)",
                [
                    (a.adapter, a.base_digest, a.updated_ms, a.canary_percent, a.replicas)
                    for a in adapters
                ],
            )
            self._db.executemany(
                "DELETE FROM aliases WHERE adapter = ?", [(a.adapter,) for a in adapters]
            )
            self._db.executemany(
                "INSERT INTO aliases VALUES (?, ?, ?)",
                [(name, alias, n) for name, (served, _) in sanctioned.items()
                 for alias, n in served.items()],
            )  # fmt: skip
            self._db.executemany(
                "DELETE FROM held_moves WHERE adapter = ?", [(a.adapter,) for a in adapters]
            )
            self._db.executemany(
                "INSERT INTO held_moves VALUES (?, ?, ?, ?)",
                [(h.adapter, h.alias, h.registry_revision, h.serving_revision)
                 for _, held in sanctioned.values() for h in held],
            )  # fmt: skip
            self._db.execute(
                "INSERT INTO meta VALUES ('cursor_ms', ?) ON CONFLICT (key) DO UPDATE "
                "SET value = max(CAST(value AS INTEGER), excluded.value)",
                (newest,),
            )

    def put_revisions(self, revisions: Iterable[RegisteredRevision]) -> None:
        """Keep these revisions' records. Of their tags, the policy's are kept once, as the
        record, and the histories (stage moves, alias moves) not at all: they grow without
        bound and `mint history` reads them from the registry."""
        rows = [
            (
                registered.id.adapter,
                registered.id.number,
                registered.artifact_uri,
                registered.policy.to_json(compact=True),
                json.dumps(_serving_tags(registered.tags), separators=(",", ":")),
            )
            for registered in revisions
        ]
        with self._lock, self._db:
            self._db.execute("BEGIN")
            self._db.executemany("INSERT OR REPLACE INTO revisions VALUES (?, ?, ?, ?, ?)", rows)

    def alias_target(self, adapter: str, alias: str) -> int | None:
        with self._lock:
            found = self._db.execute(
                "SELECT number FROM aliases WHERE adapter = ? AND alias = ?", (adapter, alias)
            ).fetchone()
        return found[0] if found else None

    def held_moves(self, adapter: str | None = None) -> list[HeldMove]:
        """The aliases the registry points where the pipeline did not move them (of `adapter`;
        None: of every adapter)."""
        query = "SELECT adapter, alias, registry_number, serving_number FROM held_moves"
        with self._lock:
            if adapter is None:
                rows = self._db.execute(query + " ORDER BY 1, 2").fetchall()
            else:
                rows = self._db.execute(query + " WHERE adapter = ?", (adapter,)).fetchall()
        return [HeldMove(*row) for row in rows]

    def replicas_set(self) -> dict[str, int]:
        """Adapter -> how many workers hold each of its revisions, for the adapters whose gates
        set it (the others follow the fleet's setting)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT name, replicas FROM adapters WHERE replicas > 0"
            ).fetchall()
        return dict(rows)

    def canary(self, adapter: str) -> tuple[int, float] | None:
        """The revision number `adapter@canary` names and its share in percent; None unless
        both are set."""
        with self._lock:
            return self._db.execute(_CANARY, (CANARY, adapter)).fetchone()

    def revision(self, revision: RevisionId) -> RegisteredRevision | None:
        """The revision's record, with the aliases naming it now; None if the index does not
        hold it. Its `tags` are the ones `put_revisions` keeps."""
        with self._lock:
            found = self._db.execute(_REVISION, (revision.adapter, revision.number)).fetchone()
        if found is None:
            return None
        uri, policy, tags, aliases = found
        tags = json.loads(tags)
        return RegisteredRevision.from_tags(
            revision,
            uri,
            tags,
            aliases=tuple(sorted(aliases.split(","))) if aliases else (),
            policy=PolicyRecord.from_json(policy),
        )

    def named(self, aliases: Iterable[str], base: str | None) -> set[RevisionId]:
        """The revisions that `aliases` name, over adapters on `base` (and adapters whose base
        the registry does not record); None: every base."""
        wanted = list(aliases)
        marks = ", ".join("?" * len(wanted))
        if base is None:
            query = f"SELECT adapter, number FROM aliases WHERE alias IN ({marks})"
            parameters: list[str] = wanted
        else:
            # By base first (its index), then each adapter's aliases by primary key.
            query = (
                "SELECT aliases.adapter, aliases.number FROM adapters JOIN aliases "
                "ON aliases.adapter = adapters.name "
                f"WHERE adapters.base IN (?, '') AND aliases.alias IN ({marks})"
            )
            parameters = [base, *wanted]
        with self._lock:
            rows = self._db.execute(query, parameters).fetchall()
        return {RevisionId(adapter, number) for adapter, number in rows}

    def adapters(self) -> list[str]:
        with self._lock:
            return [name for (name,) in self._db.execute("SELECT name FROM adapters ORDER BY 1")]

    def knows(self, adapter: str) -> bool:
        with self._lock:
            found = self._db.execute("SELECT 1 FROM adapters WHERE name = ?", (adapter,))
            return found.fetchone() is not None

    def seal(self) -> None:
        """Make the file whole on its own, to be copied: the write-ahead log folded in and
        switched off (a copy must not need its `-wal` beside it)."""
        with self._lock:
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._db.execute("PRAGMA journal_mode = DELETE")


@dataclass(frozen=True)
class IndexSummary:
    """What an index file holds, as a snapshot's manifest records it."""

    cursor_ms: int
    """The registry's last-updated time of the newest change it holds: a sync goes on from
    there."""
    adapters: int
    revisions: int


def check(path: Path) -> IndexSummary:
    """What the index at `path` holds; IntegrityError unless it is whole, readable and of this
    format: what a snapshot must be before it is published. Reads only."""
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            (verdict,) = db.execute("PRAGMA quick_check").fetchone()
            meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
            (adapters,) = db.execute("SELECT count(*) FROM adapters").fetchone()
            (revisions,) = db.execute("SELECT count(*) FROM revisions").fetchone()
        finally:
            db.close()
    except sqlite3.DatabaseError as e:
        raise IntegrityError(f"catalog index {path} is damaged or not an index: {e}") from e
    if verdict != "ok":
        raise IntegrityError(f"catalog index {path} is damaged: {verdict}")
    if meta.get("format") != str(FORMAT):
        raise IntegrityError(
            f"catalog index {path} has format {meta.get('format')}, not {FORMAT}; rebuild it"
        )
    return IndexSummary(int(meta.get("cursor_ms", 0)), adapters, revisions)


def _serving_tags(tags: Mapping[str, str]) -> dict[str, str]:
    """The tags a catalog keeps: not the policy's (kept as the record) nor the histories."""
    return {
        key: value
        for key, value in tags.items()
        if key not in _POLICY_TAGS
        and key != STAGE_HISTORY_TAG
        and not key.startswith(ALIAS_MOVE_TAG)
    }
