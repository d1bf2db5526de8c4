"""Catalog snapshots: the whole catalog index as one file in the artifact store, which the
control plane publishes (`mint catalog snapshot`) so that a worker starts from it instead of
reading every revision from MLflow, then follows the registry from the snapshot's cursor.

    catalog/<hex>.sqlite    an index file, named by its sha256, never overwritten
    catalog/latest.json     the manifest naming the current one: its digest, size, cursor

Publishing checks the file first (whole, readable, this format) and stores it under its digest;
only then is the manifest replaced, in one step. A damaged or partial file therefore never
becomes the current snapshot, and a publisher killed half-way leaves the previous one current.
Loading checks what it fetched against the manifest's digest.

Each publish then prunes: index files other than the newest `keep` (by when they were stored)
and the current one are removed. The newest are kept whoever wrote them, so a publisher that
has stored its file but not yet its manifest loses nothing; and a reader whose manifest went
stale while it fetched (its file pruned meanwhile) reads the manifest again.
"""

import json
import os
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from mint_core.artifacts.digests import sha256_file
from mint_core.artifacts.stores import ArtifactStore
from mint_core.catalog.index import check
from mint_core.config import DEFAULT_CATALOG_SNAPSHOTS
from mint_core.errors import ConfigurationError, IntegrityError

FOLDER = "catalog"
MANIFEST = f"{FOLDER}/latest.json"
INDEX_SUFFIX = ".sqlite"
FETCH_TRIES = 3
"""Manifests a fetch follows when the file each names was pruned before it was read."""


@dataclass(frozen=True)
class Snapshot:
    """A published catalog index, as its manifest describes it."""

    digest: str
    """sha256 of the index file."""
    size: int
    """Its bytes."""
    cursor_ms: int
    """The registry's last-updated time of the newest change it holds: a worker's sync goes on
    from there."""
    adapters: int
    revisions: int
    published_at: str
    """ISO-8601 UTC."""

    @property
    def name(self) -> str:
        """The index file's name in the store."""
        return f"{FOLDER}/{self.digest.removeprefix('sha256:')}{INDEX_SUFFIX}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "Snapshot":
        try:
            return cls(**json.loads(text))
        except (ValueError, TypeError) as e:
            raise IntegrityError(f"catalog snapshot manifest is not readable: {e}") from e


def publish(store: ArtifactStore, path: Path, keep: int = DEFAULT_CATALOG_SNAPSHOTS) -> Snapshot:
    """Make the sealed index file at `path` the current snapshot in `store`, then `prune` to
    the newest `keep`. IntegrityError, with the current snapshot left as it was, if the file is
    damaged."""
    if keep < 1:
        raise ConfigurationError(
            f"keep={keep} catalog snapshots would remove the current one: keep at least 1 "
            "(MINT_CATALOG_SNAPSHOTS)"
        )
    summary = check(path)
    snapshot = Snapshot(
        digest=sha256_file(path),
        size=path.stat().st_size,
        cursor_ms=summary.cursor_ms,
        adapters=summary.adapters,
        revisions=summary.revisions,
        published_at=datetime.now(UTC).isoformat(),
    )
    store.put_file(snapshot.name, path)
    manifest = path.with_name(path.name + ".manifest.json")
    manifest.write_text(snapshot.to_json())
    try:
        store.put_file(MANIFEST, manifest)  # the snapshot is current from here on
    finally:
        manifest.unlink()
    prune(store, keep, snapshot)
    return snapshot


def prune(store: ArtifactStore, keep: int, current: Snapshot) -> list[str]:
    """Remove the index files in `store` older than the newest `keep`, but never `current`'s;
    the names removed, oldest first. Files stored at the same time as the last one kept are
    kept too: a store's clock (S3's is in seconds) cannot tell which of them is newer."""
    stored = {
        name: when for name, when in store.list_files(FOLDER).items() if name.endswith(INDEX_SUFFIX)
    }
    by_age = sorted(stored, key=lambda name: stored[name])
    if len(by_age) <= keep:
        return []
    oldest_kept = stored[by_age[-keep]]
    removed = [n for n in by_age if stored[n] < oldest_kept and n != current.name]
    for name in removed:
        store.delete_file(name)
    return removed


def current(store: ArtifactStore, scratch: Path) -> Snapshot | None:
    """The current snapshot's manifest; None if none was ever published."""
    manifest = scratch / "catalog-manifest.json"
    try:
        if not store.get_file(MANIFEST, manifest):
            return None
        return Snapshot.from_json(manifest.read_text())
    finally:
        manifest.unlink(missing_ok=True)


def fetch(store: ArtifactStore, target: Path) -> Snapshot | None:
    """Copy the current snapshot's index file to `target`, checked against its digest; None if
    none was ever published. IntegrityError (and no `target`) if the copy does not match."""
    snapshot = current(store, target.parent)
    if snapshot is None:
        return None
    staging = target.with_name(target.name + ".fetching")
    try:
        for _ in range(FETCH_TRIES):
            if store.get_file(snapshot.name, staging):
                break
            # Pruned after its manifest was read: the manifest now names a newer one.
            newer = current(store, target.parent)
            if newer is None or newer == snapshot:
                raise _not_stored(snapshot)
            snapshot = newer
        else:
            raise _not_stored(snapshot)
        found = sha256_file(staging)
        if found != snapshot.digest:
            raise IntegrityError(
                f"catalog snapshot {snapshot.name} has digest {found}, its manifest says "
                f"{snapshot.digest}; publish a new one (mint catalog snapshot)"
            )
        os.replace(staging, target)
    finally:
        staging.unlink(missing_ok=True)
    return snapshot


def _not_stored(snapshot: Snapshot) -> IntegrityError:
    return IntegrityError(
        f"catalog snapshot {snapshot.name} named by {MANIFEST} is not in the store; "
        "publish a new one (mint catalog snapshot)"
    )
