"""The catalog's index and its snapshot, against a real `mlflow server`: the index resolves what
the registry resolves; a snapshot goes through the artifact store (a folder, and S3 on moto)
intact; a damaged one never becomes current and a catalog refuses it; a catalog started from a
snapshot follows the registry from the snapshot's cursor, not from the beginning."""

import itertools
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import mint_cli
from mint_core.artifacts.digests import sha256_json
from mint_core.artifacts.stores import ArtifactStore, LocalArtifactStore, S3ArtifactStore
from mint_core.catalog import snapshot as catalog_snapshot
from mint_core.catalog.catalog import Catalog, build_snapshot
from mint_core.catalog.index import CatalogIndex
from mint_core.config import DEFAULT_CATALOG_SNAPSHOTS, MintConfig
from mint_core.errors import ConfigurationError, IntegrityError, NotFoundError
from mint_core.registry import AdapterAliases, RegisteredRevision, Registry
from mint_core.registry.changes import FIRST_PAGE, Changes
from mint_core.registry.revisions import Revisions
from mint_core.revisions import CANDIDATE, PRODUCTION, RevisionId, RevisionRef
from processes import ManagedProcess
from tests.helpers import make_policy
from tests.integration.helpers import create_bucket, move_alias

BASE = "sha256:" + "e" * 64
OTHER_BASE = "sha256:" + "f" * 64


_contents = itertools.count()


def register(registry: Registry, adapter: str, revisions: int, base: str = BASE) -> None:
    """`revisions` new revisions of `adapter` (metadata only: nothing is served)."""
    for _ in range(revisions):
        digest = sha256_json(["test_catalog", next(_contents)])
        policy = make_policy(adapter=adapter, content_digest=digest, base_digest=base)
        registry.revisions.register(
            policy, "mint-local://sha256/" + digest.removeprefix("sha256:"), base
        )


@pytest.fixture(scope="module")
def registry(mlflow_server: ManagedProcess, prefect_api: str) -> Registry:
    """The session registry with `forms` (r1..r3; production r2, candidate r3) and `elsewhere`
    (r1 on another base, production)."""
    registry = Registry(mlflow_server.url)
    register(registry, "forms", 3)
    move_alias(registry, RevisionId("forms", 2), PRODUCTION, reason="test")
    registry.aliases.point(RevisionId("forms", 3), CANDIDATE)
    register(registry, "elsewhere", 1, base=OTHER_BASE)
    move_alias(registry, RevisionId("elsewhere", 1), PRODUCTION, reason="test")
    return registry


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ArtifactStore:
    if request.param == "local":
        return LocalArtifactStore(tmp_path / "store")
    s3_server: ManagedProcess = request.getfixturevalue("s3_server")
    bucket = f"catalog-{request.node.name.split('[')[0].replace('_', '-')[-40:]}"
    create_bucket(s3_server.url, bucket)
    return S3ArtifactStore(bucket, "mint", s3_server.url, tmp_path / "s3-cache")


def unanswered_registry(monkeypatch: pytest.MonkeyPatch) -> Registry:
    """A registry nobody answers at, asked once: a catalog that asks it fails at once."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    return Registry("http://127.0.0.1:9")


def test_the_index_resolves_every_form_as_the_registry_does(
    registry: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalArtifactStore(tmp_path / "store")
    build_snapshot(registry, store, tmp_path / "build")
    # Only the snapshot can answer: the catalog's registry does not.
    catalog = Catalog(unanswered_registry(monkeypatch), base_digest=BASE)
    assert catalog.start_from_snapshot(store) is not None
    refs = ["forms", "forms@production", "forms@candidate", "forms:r1", "forms:r2", "forms:r3"]
    for text in refs:
        ref = RevisionRef.parse(text)
        mine, theirs = catalog.resolve(ref), registry.revisions.resolve(ref)
        assert (mine.id, mine.policy, mine.artifact_uri, mine.stage, mine.aliases) == (
            theirs.id, theirs.policy, theirs.artifact_uri, theirs.stage, theirs.aliases
        ), text  # fmt: skip
    assert catalog.alias_target("forms", PRODUCTION) == 2
    assert catalog.knows("forms") and catalog.knows("elsewhere")
    wanted = {r for r in catalog.desired() if r.adapter in ("forms", "elsewhere")}
    assert wanted == {RevisionId("forms", 2), RevisionId("forms", 3)}  # not the other base's
    catalog.close()

    following = Catalog(registry)
    following.start_from_snapshot(store)
    with pytest.raises(NotFoundError):
        following.resolve(RevisionRef.parse("forms:r9"))
    with pytest.raises(NotFoundError):
        following.resolve(RevisionRef.parse("forms@nowhere"))
    following.close()


def index_file(path: Path, adapters: int) -> Path:
    """A sealed index of `adapters` adapters, each with a production alias and no revisions."""
    index = CatalogIndex(path)
    named = [AdapterAliases(f"a{n}", {PRODUCTION: 1}, 1000 + n, BASE) for n in range(adapters)]
    index.put_adapters(named)
    index.seal()
    index.close()
    return path


def test_a_snapshot_goes_through_the_store_intact(store: ArtifactStore, tmp_path: Path) -> None:
    built = index_file(tmp_path / "built.sqlite", adapters=300)
    published = catalog_snapshot.publish(store, built)
    assert (published.adapters, published.revisions, published.cursor_ms) == (300, 0, 1299)

    fetched = catalog_snapshot.fetch(store, tmp_path / "fetched.sqlite")
    assert fetched == published
    assert (tmp_path / "fetched.sqlite").read_bytes() == built.read_bytes()


def test_a_damaged_snapshot_never_replaces_a_good_one(store: ArtifactStore, tmp_path: Path) -> None:
    good = catalog_snapshot.publish(store, index_file(tmp_path / "good.sqlite", adapters=10))
    damaged = index_file(tmp_path / "damaged.sqlite", adapters=3000)
    with damaged.open("r+b") as file:  # a page in the middle overwritten, as a bad disk would
        file.seek(damaged.stat().st_size // 2)
        file.write(b"\xff" * 4096)

    with pytest.raises(IntegrityError, match="damaged"):
        catalog_snapshot.publish(store, damaged)
    assert catalog_snapshot.current(store, tmp_path) == good
    assert catalog_snapshot.fetch(store, tmp_path / "fetched.sqlite") == good


def test_publishing_keeps_the_newest_snapshots_and_never_the_current_one_away(
    store: ArtifactStore, tmp_path: Path
) -> None:
    published = []
    for n in range(4):
        built = index_file(tmp_path / f"{n}.sqlite", adapters=n + 1)
        published.append(catalog_snapshot.publish(store, built, keep=2))
        time.sleep(1.1)  # S3 dates what it stores to the second
    assert len({snapshot.digest for snapshot in published}) == 4
    kept = {snapshot.name for snapshot in published[-2:]}
    assert set(store.list_files("catalog")) == {catalog_snapshot.MANIFEST, *kept}
    assert catalog_snapshot.fetch(store, tmp_path / "fetched.sqlite") == published[-1]

    with pytest.raises(ConfigurationError, match="keep at least 1"):
        catalog_snapshot.publish(store, tmp_path / "0.sqlite", keep=0)
    with pytest.raises(ConfigurationError, match="catalog_snapshots=0"):
        MintConfig.from_env({"MINT_CATALOG_SNAPSHOTS": "0"})
    assert MintConfig().catalog_snapshots == DEFAULT_CATALOG_SNAPSHOTS


class PublishedMeanwhile(LocalArtifactStore):
    """A store where, between a reader's look at the manifest and its copy of the file the
    manifest names, another snapshot is published keeping only itself."""

    def __init__(self, root: Path, newer: Path) -> None:
        super().__init__(root)
        self.newer: Path | None = newer

    def get_file(self, name: str, target: Path) -> bool:
        if name.endswith(".sqlite") and self.newer is not None:
            newer, self.newer = self.newer, None
            catalog_snapshot.publish(self, newer, keep=1)
        return super().get_file(name, target)


def test_a_reader_whose_snapshot_was_pruned_meanwhile_fetches_the_newer_one(
    tmp_path: Path,
) -> None:
    store = PublishedMeanwhile(tmp_path / "store", index_file(tmp_path / "new.sqlite", 20))
    old = catalog_snapshot.publish(store, index_file(tmp_path / "old.sqlite", 10))
    fetched = catalog_snapshot.fetch(store, tmp_path / "fetched.sqlite")
    assert fetched is not None and fetched != old and fetched.adapters == 20
    assert set(store.list_files("catalog")) == {catalog_snapshot.MANIFEST, fetched.name}


def test_a_catalog_refuses_a_snapshot_damaged_in_the_store(
    registry: Registry, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = LocalArtifactStore(tmp_path / "store")
    snapshot = build_snapshot(registry, store, tmp_path / "build")
    stored = store.root / snapshot.name
    stored.write_bytes(stored.read_bytes()[:-4096])  # cut short after it was published

    catalog = Catalog(registry, base_digest=BASE)
    with caplog.at_level(logging.WARNING, logger="mint_core.catalog.catalog"):
        assert catalog.start_from_snapshot(store) is None
    assert "has digest sha256:" in caplog.text and snapshot.digest in caplog.text
    assert catalog.alias_target("forms", PRODUCTION) is None  # nothing taken from it
    catalog.sync()  # from the registry alone, everything
    assert catalog.resolve(RevisionRef("forms")).id == RevisionId("forms", 2)
    catalog.close()


@dataclass(frozen=True)
class CountingChanges(Changes):
    """`Changes` that records each time a catalog asks for them."""

    asked: list[int] = field(default_factory=list)

    def since(self, since_ms: int, page_size: int = FIRST_PAGE) -> list[AdapterAliases]:
        self.asked.append(since_ms)
        return super().since(since_ms, page_size)


@dataclass(frozen=True)
class CountingRevisions(Revisions):
    """`Revisions` that records each full read (`pages`)."""

    full_reads: list[int] = field(default_factory=list)

    def pages(self, page_size: int = 1000) -> Iterator[list[RegisteredRevision]]:
        self.full_reads.append(page_size)
        return super().pages(page_size)


class CountingRegistry(Registry):
    """A registry that records what a catalog asks it for."""

    def __init__(self, tracking_uri: str) -> None:
        super().__init__(tracking_uri)
        self.changes = self.counted_changes = CountingChanges(self.store)
        self.revisions = self.counted_revisions = CountingRevisions(
            self.store, self.runs, self.grants
        )

    @property
    def since(self) -> list[int]:
        return self.counted_changes.asked

    @property
    def full_reads(self) -> int:
        return len(self.counted_revisions.full_reads)


def test_a_catalog_follows_the_registry_from_its_snapshot(
    registry: Registry, tmp_path: Path
) -> None:
    store = LocalArtifactStore(tmp_path / "store")
    register(registry, "later", 1)
    move_alias(registry, RevisionId("later", 1), PRODUCTION, reason="test")
    snapshot = build_snapshot(registry, store, tmp_path / "build")
    # After the snapshot: a new revision, and production moved to it.
    register(registry, "later", 1)
    move_alias(registry, RevisionId("later", 2), PRODUCTION, reason="test")

    counting = CountingRegistry(registry.tracking_uri)
    catalog = Catalog(counting, base_digest=BASE)
    assert catalog.start_from_snapshot(store) == snapshot
    assert catalog.alias_target("later", PRODUCTION) == 1  # as of the snapshot
    assert RevisionId("later", 1) in catalog.desired()
    changed = catalog.sync()

    assert counting.since == [snapshot.cursor_ms - 2000]  # from its cursor, not from 0
    assert counting.full_reads == 0
    assert "later" in changed
    assert catalog.resolve(RevisionRef("later")).id == RevisionId("later", 2)
    assert RevisionId("later", 2) in catalog.desired()
    assert RevisionId("later", 1) not in catalog.desired()
    catalog.close()


def test_a_catalog_without_a_snapshot_reads_everything_once(
    registry: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counting = CountingRegistry(registry.tracking_uri)
    catalog = Catalog(counting)
    assert catalog.start_from_snapshot(LocalArtifactStore(tmp_path / "empty")) is None
    catalog.sync()
    catalog.sync()
    assert counting.full_reads == 1
    assert counting.since[0] == 0 and counting.since[1] > 0
    # Every revision is held after the first sync: none needs the registry.
    catalog.registry = unanswered_registry(monkeypatch)
    assert (
        catalog.record(RevisionId("forms", 1)).policy
        == registry.revisions.get(RevisionId("forms", 1)).policy
    )
    catalog.close()


def test_mint_catalog_snapshot_publishes_one(
    registry: Registry,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("MINT_HOME", str(home))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", registry.tracking_uri)
    monkeypatch.setenv("MINT_ARTIFACT_STORE", "local")

    assert mint_cli.main(["catalog", "snapshot"]) == 0

    snapshot = catalog_snapshot.current(LocalArtifactStore(home / "artifacts"), tmp_path)
    assert snapshot is not None and snapshot.adapters >= 2  # forms and elsewhere at least
    assert snapshot.digest in capsys.readouterr().out


def test_a_killed_processs_catalog_files_are_removed_by_the_next_catalog_in_its_folder(
    registry: Registry, tmp_path: Path
) -> None:
    folder = tmp_path / "catalog"
    running = Catalog(registry, folder=folder)  # this process's: it runs, so it stays
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_WITH_ITS_CATALOG, registry.tracking_uri, str(folder)],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    left = Path(killed.stdout.strip())
    assert left.exists() and Path(f"{left}-wal").exists()  # a worker's, as SIGKILL leaves it

    restarted = Catalog(registry, folder=folder)
    names = sorted(path.name for path in folder.iterdir())
    assert not [name for name in names if name.startswith(left.name)], names
    mine = (running.index_path.name, restarted.index_path.name)
    assert all(name.startswith(mine) for name in names), names
    running.close()
    restarted.close()
    assert list(folder.iterdir()) == []


KILLED_WITH_ITS_CATALOG = """
import os, signal, sys
from pathlib import Path
from mint_core.catalog.catalog import Catalog
from mint_core.registry import Registry

catalog = Catalog(Registry(sys.argv[1]), folder=Path(sys.argv[2]))
catalog.sync()
print(catalog.index_path, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
