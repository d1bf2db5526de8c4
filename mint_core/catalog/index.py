"""The catalog's index: what the registry says, in one sqlite file rather than Python objects.

One row per adapter (its base, last-updated time and canary share), per alias, and per revision
(its artifact, its policy record as compact JSON, its other tags). A lookup is a primary-key
search in a B-tree: fast at a million revisions, and the memory it takes is sqlite's page cache
(bounded here), not an object per revision. The same file is the catalog snapshot the control plane
publishes (`catalog.snapshot`): a worker starts from a copy of it and keeps it current.

Workers look revisions up from many threads. Each thread reads through a connection of its own
(WAL: readers never wait for the writer nor for each other, and no lock is shared), with a small
cache of its own that holds the B-trees' upper pages; the leaves come from the OS's page cache.
Writes (a sync's) go through one connection under a lock. A statement read through a thread's
connection sees every write committed before it started.
"""

import json
import os
import sqlite3
import threading
import weakref
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
"""sqlite's page cache of the writing connection (a sync's pages)."""
READER_CACHE_KIB = 4 << 10
"""sqlite's page cache of each thread's reading connection: enough for the B-trees' interior
pages at a million revisions (~3 MB), so a lookup reads only its leaves from the OS."""
MMAP_BYTES = 0
"""How much of the file a connection maps into memory: none. Measured at 10^6 revisions, a
mapped index (all of it, `PRAGMA mmap_size`) made a lookup's query ~3 µs faster (p50 16 vs 20
µs, the policy record's decoding not included) but made the whole 1 GB file resident in the
process after 50,000 random lookups: the kernel maps the page cache's large folios whole around
each page touched, MADV_RANDOM or not. Read through sqlite's cache, those pages stay the OS's."""
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
_NAMES_PER_QUERY = 500
"""Adapters named in one `IN (...)` query: well under sqlite's limit on bound values."""

_SERVED_COLUMNS = {
    "adapters": ("name", "base", "canary_percent", "replicas"),
    "aliases": ("adapter", "alias", "number"),
    "held_moves": ("adapter", "alias", "registry_number", "serving_number"),
}
"""What the index holds of an adapter, by table, its name first (`adapters.updated_ms` aside:
the registry moves it without a change workers see, and leaves it when an alias is moved by
hand)."""


# `revisions` keeps sqlite's rowid: its rows (~1 KB) are too large for a WITHOUT ROWID table
# to pay off, so a small unique index finds them.


class CatalogIndex:
    """The registry's adapters, aliases and revisions in the sqlite file at `path`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        """Held to write, and to open or close connections."""
        self._db = self._open(path)
        self._closed = False
        self._generation = 0
        """Counts the times the file was replaced (or the readers closed): a thread's reader of
        an older generation is opened again."""
        self._local = threading.local()
        self._readers: weakref.WeakSet[_Reader] = weakref.WeakSet()
        """Every thread's reader, to close them all (a thread that ends takes its own along)."""

    @staticmethod
    def _open(path: Path) -> sqlite3.Connection:
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        try:
            db.execute(f"PRAGMA cache_size = -{CACHE_KIB}")
            db.execute(f"PRAGMA mmap_size = {MMAP_BYTES}")
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
            self._closed = True
            self._close_readers()
            self._db.close()

    def _close_readers(self) -> None:
        """Close every thread's reader (each under its own lock: not while its thread reads);
        each thread opens a new one when it next reads. Holds `_lock`."""
        self._generation += 1
        for reader in list(self._readers):
            with reader.lock:
                if reader.db is not None:
                    reader.db.close()
                    reader.db = None

    def _reader(self) -> "_Reader":
        """This thread's reader, opened on first use and again after the file was replaced."""
        reader: _Reader | None = getattr(self._local, "reader", None)
        if reader is not None and reader.generation == self._generation:
            return reader
        with self._lock:
            if self._closed:
                raise sqlite3.ProgrammingError(f"catalog index {self.path} is closed")
            # mode=rw: never creates a file where there is none.
            db = sqlite3.connect(
                f"file:{self.path}?mode=rw", uri=True, check_same_thread=False,
                isolation_level=None,
            )  # fmt: skip
            db.execute(f"PRAGMA cache_size = -{READER_CACHE_KIB}")
            db.execute(f"PRAGMA mmap_size = {MMAP_BYTES}")
            db.execute("PRAGMA query_only = ON")
            reader = _Reader(db, self._generation)
            self._readers.add(reader)
        self._local.reader = reader
        return reader

    def _read(self, query: str, parameters: Sequence[object] = ()) -> list[tuple]:
        """The rows `query` finds, read through this thread's connection without `_lock`. All
        of them: a statement stepped to its end ends its read transaction, so the next read
        sees the writes committed meanwhile."""
        while True:
            reader = self._reader()
            with reader.lock:  # taken by no other thread but to close it
                if reader.db is not None:
                    return reader.db.execute(query, parameters).fetchall()
            # closed meanwhile (the file replaced): this thread opens the new one

    def replace_with(self, file: Path) -> None:
        """Hold what the index file `file` holds from now on, in place of all this index held:
        `file` is moved to this index's path. IntegrityError, and an empty index, if `file` is
        not an index of this format."""
        with self._lock:
            self._close_readers()
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

    def put_adapters(self, adapters: Sequence[AdapterAliases]) -> list[AdapterAliases]:
        """These adapters' bases, aliases and canary shares as the registry has them now; moves
        the cursor to the newest of their last-updated times. The aliases kept are those the
        pipeline moved; the others are kept as held moves. Returns those that changed: an
        adapter the registry reports again as the index holds it (a sync's overlap, an audit's
        full read) is neither written nor returned."""
        if not adapters:
            return []
        newest = max(adapter.updated_ms for adapter in adapters)
        sanctioned = {a.adapter: a.sanctioned() for a in adapters}
        served = {
            "adapters": [(a.adapter, a.base_digest, a.canary_percent, a.replicas)
                         for a in adapters],
            "aliases": [(name, alias, n) for name, (aliases, _) in sanctioned.items()
                        for alias, n in aliases.items()],
            "held_moves": [(h.adapter, h.alias, h.registry_revision, h.serving_revision)
                           for _, held in sanctioned.values() for h in held],
        }  # fmt: skip
        with self._lock, self._db:
            self._db.execute("BEGIN")
            if self._db.execute("SELECT 1 FROM adapters LIMIT 1").fetchone() is None:
                changed = {a.adapter for a in adapters}  # a first sync: nothing to compare
            else:
                changed = self._differing([a.adapter for a in adapters], served)
            names = [(name,) for name in changed]
            self._db.executemany(
                "INSERT OR REPLACE INTO adapters VALUES (?, ?, ?, ?, ?)",
                [(a.adapter, a.base_digest, a.updated_ms, a.canary_percent, a.replicas)
                 for a in adapters if a.adapter in changed],
            )  # fmt: skip
            for table in ("aliases", "held_moves"):
                self._db.executemany(f"DELETE FROM {table} WHERE adapter = ?", names)
                marks = ", ".join("?" * len(_SERVED_COLUMNS[table]))
                self._db.executemany(
                    f"INSERT INTO {table} VALUES ({marks})",
                    [row for row in served[table] if row[0] in changed],
                )
            self._db.execute(
                "INSERT INTO meta VALUES ('cursor_ms', ?) ON CONFLICT (key) DO UPDATE "
                "SET value = max(CAST(value AS INTEGER), excluded.value)",
                (newest,),
            )
        return [a for a in adapters if a.adapter in changed]

    def _differing(self, names: Sequence[str], served: Mapping[str, list[tuple]]) -> set[str]:
        """Those of `names` whose rows in the index differ from `served` (table -> the rows
        the adapters should have there, each starting with the adapter's name), or that the
        index does not hold. Under the writing lock."""
        differing: set[str] = set()
        for table, rows in served.items():
            columns = _SERVED_COLUMNS[table]
            stored: set[tuple] = set()
            for start in range(0, len(names), _NAMES_PER_QUERY):
                chunk = names[start : start + _NAMES_PER_QUERY]
                query = (
                    f"SELECT {', '.join(columns)} FROM {table} "
                    f"WHERE {columns[0]} IN ({', '.join('?' * len(chunk))})"
                )
                stored.update(self._db.execute(query, chunk))
            differing.update(row[0] for row in stored.symmetric_difference(rows))
        return differing

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
        found = self._read(
            "SELECT number FROM aliases WHERE adapter = ? AND alias = ?", (adapter, alias)
        )
        return found[0][0] if found else None

    def held_moves(self, adapter: str | None = None) -> list[HeldMove]:
        """The aliases the registry points where the pipeline did not move them (of `adapter`;
        None: of every adapter)."""
        query = "SELECT adapter, alias, registry_number, serving_number FROM held_moves"
        if adapter is None:
            rows = self._read(query + " ORDER BY 1, 2")
        else:
            rows = self._read(query + " WHERE adapter = ?", (adapter,))
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
        found = self._read(_CANARY, (CANARY, adapter))
        return found[0] if found else None

    def revision(self, revision: RevisionId) -> RegisteredRevision | None:
        """The revision's record, with the aliases naming it now; None if the index does not
        hold it. Its `tags` are the ones `put_revisions` keeps."""
        found = self._read(_REVISION, (revision.adapter, revision.number))
        if not found:
            return None
        ((uri, policy, tags, aliases),) = found
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
        names = list(aliases)
        marks = ", ".join("?" * len(names))
        if base is None:
            query = f"SELECT adapter, number FROM aliases WHERE alias IN ({marks})"
            parameters: list[str] = names
        else:
            # By base first (its index), then each adapter's aliases by primary key.
            query = (
                "SELECT aliases.adapter, aliases.number FROM adapters JOIN aliases "
                "ON aliases.adapter = adapters.name "
                f"WHERE adapters.base IN (?, '') AND aliases.alias IN ({marks})"
            )
            parameters = [base, *names]
        with self._lock:
            rows = self._db.execute(query, parameters).fetchall()
        return {RevisionId(adapter, number) for adapter, number in rows}

    def adapters(self) -> list[str]:
        with self._lock:
            return [name for (name,) in self._db.execute("SELECT name FROM adapters ORDER BY 1")]

    def knows(self, adapter: str) -> bool:
        return bool(self._read("SELECT 1 FROM adapters WHERE name = ?", (adapter,)))

    def seal(self) -> None:
        """Make the file whole on its own, to be copied: the write-ahead log folded in and
        switched off (a copy must not need its `-wal` beside it)."""
        with self._lock:
            self._close_readers()  # WAL is left only by the file's one connection
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._db.execute("PRAGMA journal_mode = DELETE")


class _Reader:
    """One thread's read connection; `lock` is held while it reads and while it is closed."""

    __slots__ = ("__weakref__", "db", "generation", "lock")

    def __init__(self, db: sqlite3.Connection, generation: int) -> None:
        self.db: sqlite3.Connection | None = db
        self.generation = generation
        self.lock = threading.Lock()


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
