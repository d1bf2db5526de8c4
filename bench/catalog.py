"""Catalog benchmark: the catalog at a million revisions, and syncing one from a real MLflow.

Two catalogs, one run:

- 1,000,000 revisions over 100,000 adapters on 50 bases (production on each adapter's r9,
  candidate on r10 for one adapter in ten), written through the catalog index's own writer
  straight into the snapshot format (creating a million MLflow versions over REST would take
  hours here), in a child process, and published in a local artifact store. A catalog in this
  process then starts from it, its pages evicted from the page cache first: cold start is
  fetching it from the store (copy + digest check) and opening it, up to its first answer. Then
  resolves of a random mix of `name`, `name@alias` and `name:rN`, uniform over every adapter
  (one thread, each timed; then another such mix from 8 threads at once); a skewed mix from 8
  threads, as traffic is: the adapters drawn Zipf-distributed (s = `ZIPF_S`, popularity in a
  random order), the forms as before (the catalog keeps recent answers in memory, its hot map,
  which serve the popular ones without sqlite, while the uniform mix is nearly all misses); the
  resident memory the catalog added to this process (RSS after all those resolves minus RSS
  before the cold start: anonymous and file-backed pages both); and `desired()` for one base.
- 10,000 versions over 1,000 adapters in a real `mlflow server` (the tags a release writes,
  production on r9; written by MLflow's client into the server's database, while the million
  is built, timed but not a catalog figure). A fresh catalog's first sync reads them all over
  REST: versions per second. Then the million catalog, synced every second as a worker's
  watcher does, sees alias moves made in that MLflow (`registry.aliases.move`): the time from
  the move's return to the catalog answering with the new revision, and from its start.

Prints the figures and writes bench/results/catalog.json.

    .venv/bin/python bench/catalog.py                                     # the full run (~12 min)
    .venv/bin/python bench/catalog.py --adapters 2000 --mlflow-adapters 50 --moves 2   # smoke
"""

import argparse
import logging
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
# Alias moves take their adapter's roll-out slot, a Prefect limit (Prefect's temporary server).
# Named, not made: Prefect makes it when it first writes (a mkdtemp here was a folder left
# behind by every run, used or not).
os.environ.setdefault(
    "PREFECT_HOME", os.path.join(tempfile.gettempdir(), f"mint-bench-prefect-{os.getpid()}")
)

import psutil
from mlflow.tracking import MlflowClient

from bench import harness
from mint_core.artifacts.digests import sha256_json
from mint_core.artifacts.stores import LocalArtifactStore
from mint_core.catalog import snapshot as catalog_snapshot
from mint_core.catalog.catalog import HOT_ANSWERS, Catalog
from mint_core.catalog.index import CatalogIndex, check
from mint_core.registry import KIND_TAG, STAGE_TAG, AdapterAliases, RegisteredRevision, Registry
from mint_core.revisions import (
    CANDIDATE,
    PRODUCTION,
    TAG_PREFIX,
    PolicyRecord,
    RevisionId,
    RevisionRef,
)
from mint_core.states import Stage
from processes import ManagedProcess
from tasks.pipeline import rollout_lock

SYNC_INTERVAL_S = 1.0
"""A worker's default (serving.worker.worker.DEFAULT_SYNC_INTERVAL_S)."""
THREADS = 8
ZIPF_S = 1.0
"""The skew of the 8-thread skewed mix: the k-th most popular adapter is asked 1/k as often as
the first (Zipf's law with s = 1; at 100,000 adapters the top 1,000 take ~62% of requests)."""


def base_digest(number: int) -> str:
    return sha256_json(["bench-base", number])


def policy(adapter: str, number: int, base: int) -> PolicyRecord:
    """A release's policy record: every field filled as a trained revision's is."""
    content = sha256_json([adapter, number])
    return PolicyRecord(
        adapter=adapter,
        content_digest=content,
        base_model_id=f"bench-family-{base}",
        base_digest=base_digest(base),
        training_steps=400,
        dataset_digest=sha256_json(["data", adapter, number]),
        lora_rank=16,
        lora_alpha=32,
        target_modules=("q_proj", "k_proj", "v_proj", "o_proj"),
        created_by="bench",
        created_at="2026-11-30T12:00:00.000000+00:00",
        dataset=f"s3://bench-data/{adapter}/train.jsonl",
        parent_revision=number - 1 if number > 1 else None,
        frozen_digest=sha256_json(["frozen", adapter, number]),
        eval_metrics={"eval_loss": 0.1, "eval_exact_match": 0.9},
    )


def aliases_of(adapter_number: int, revisions: int) -> dict[str, int]:
    """Production one before the newest; candidate on the newest for one adapter in ten."""
    aliases = {PRODUCTION: revisions - 1}
    if adapter_number % 10 == 0:
        aliases[CANDIDATE] = revisions
    return aliases


def build_synthetic(path: Path, adapters: int, revisions: int, bases: int) -> dict[str, float]:
    """The million-revision index at `path`, sealed (run in a child process)."""
    start = time.perf_counter()
    index = CatalogIndex(path)
    cursor_ms = int(time.time() * 1000)
    for first in range(0, adapters, 1000):
        records, named = [], []
        for a in range(first, min(first + 1000, adapters)):
            name, base = f"bench-{a:06d}", a % bases
            for n in range(1, revisions + 1):
                record = policy(name, n, base)
                uri = "mint-local://sha256/" + record.content_digest.removeprefix("sha256:")
                tags = {STAGE_TAG: Stage.REGISTERED.value}
                records.append(
                    RegisteredRevision(RevisionId(name, n), record, uri, Stage.REGISTERED, (), tags)
                )
            updated_ms = cursor_ms - adapters + a
            named.append(
                AdapterAliases(name, aliases_of(a, revisions), updated_ms, base_digest(base))
            )
        index.put_revisions(records)
        index.put_adapters(named)
    index.seal()
    index.close()
    return {"build_s": time.perf_counter() - start, "bytes": path.stat().st_size}


def rss() -> int:
    """Resident pages, anonymous and file-backed (a mapped file's pages count)."""
    return psutil.Process().memory_info().rss


def rss_file() -> int:
    """Of `rss`, the file-backed pages (mapped files: libraries, and any index mapped)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    return 0


def quantiles_us(samples_ns: list[int]) -> dict[str, float]:
    ordered = sorted(samples_ns)
    at = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000  # noqa: E731
    return {"p50_us": at(0.50), "p99_us": at(0.99), "max_us": ordered[-1] / 1000}


def lookups(
    count: int, adapters: int, revisions: int, seed: int, zipf_s: float | None = None
) -> list[RevisionRef]:
    """A random mix of the three forms, over every adapter uniformly, or (`zipf_s`) drawn
    Zipf-distributed with the adapters' popularity in a random order."""
    rng = random.Random(seed)
    if zipf_s is None:
        drawn = [rng.randrange(adapters) for _ in range(count)]
    else:
        popular = list(range(adapters))
        rng.shuffle(popular)
        weights = [1 / (rank + 1) ** zipf_s for rank in range(adapters)]
        drawn = [popular[r] for r in rng.choices(range(adapters), weights, k=count)]
    refs = []
    for a in drawn:
        name = f"bench-{a:06d}"
        form = rng.randrange(3)
        if form == 0:
            refs.append(RevisionRef(name))
        elif form == 1:
            refs.append(RevisionRef(name, alias=rng.choice(sorted(aliases_of(a, revisions)))))
        else:
            refs.append(RevisionRef(name, revision=rng.randint(1, revisions)))
    return refs


def threaded_resolves(catalog: Catalog, refs: list[RevisionRef]) -> tuple[float, list[int]]:
    """Resolves per second of `refs` shared among `THREADS` threads at once, and each one's
    time. The threads are started before the clock."""
    shares = [refs[n::THREADS] for n in range(THREADS)]
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(lambda _: None, range(THREADS)))
        start = time.perf_counter()
        samples = [s for part in pool.map(lambda p: timed_resolves(catalog, p), shares)
                   for s in part]  # fmt: skip
        took = time.perf_counter() - start
    return len(refs) / took, samples


def timed_resolves(catalog: Catalog, refs: list[RevisionRef]) -> list[int]:
    samples = []
    for ref in refs:
        start = time.perf_counter_ns()
        catalog.resolve(ref)
        samples.append(time.perf_counter_ns() - start)
    return samples


def create_mlflow_versions(
    database_uri: str, adapters: int, revisions: int, base: int
) -> dict[str, float]:
    """`adapters` x `revisions` model versions with a release's tags, production on the one
    before the newest, as `Revisions.register` writes them (without the training run and the
    policy artifact it also logs: no catalog reads them). MLflow's client writes them straight
    into the server's database, one at a time (run in a child process): over REST they came at
    about 20 per second here, with threads or without, 10,000 in 9 minutes."""
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    client = MlflowClient(tracking_uri=database_uri, registry_uri=database_uri)
    registry = Registry(database_uri)
    start = time.perf_counter()
    for a in range(adapters):
        name = f"mlflow-{a:04d}"
        client.create_registered_model(
            name, tags={KIND_TAG: "adapter", TAG_PREFIX + "base_digest": base_digest(base)}
        )
        for n in range(1, revisions + 1):
            record = policy(name, n, base)
            uri = "mint-local://sha256/" + record.content_digest.removeprefix("sha256:")
            tags = {**record.to_tags(), STAGE_TAG: Stage.REGISTERED.value}
            client.create_model_version(name, source=uri, tags=tags, await_creation_for=0)
        registry.aliases.point(RevisionId(name, revisions - 1), PRODUCTION)
    return {"create_s": time.perf_counter() - start}


class Watcher:
    """A worker's watcher: sync, then `desired()`, every `SYNC_INTERVAL_S`."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.sync_s: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            self.catalog.sync()
            self.catalog.desired()
            self.sync_s.append(time.perf_counter() - start)
            self._stop.wait(SYNC_INTERVAL_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def alias_moves(
    catalog: Catalog, registry: Registry, moves: int, revisions: int
) -> tuple[list[float], list[float], list[float]]:
    """Seconds until `catalog` answers with each alias move made in MLflow: from the move's
    return (the mover's "done"), and from its start (its five requests to MLflow included);
    and the seconds each of the watcher's rounds (sync + `desired()`) took, the first one
    catching up with the snapshot. The moves start once that first round is over."""
    rng = random.Random(1)
    after_return, after_start = [], []
    watcher = Watcher(catalog)
    while not watcher.sync_s:  # its first round catches up with what changed since the snapshot
        time.sleep(0.01)
    try:
        for move in range(moves):
            name = f"mlflow-{move:04d}"
            target = RevisionId(name, revisions)  # production moves to the newest
            time.sleep(rng.uniform(0, SYNC_INTERVAL_S))  # not in step with the watcher
            with rollout_lock(name) as slot:  # as every alias move takes it; not timed
                start = time.perf_counter()
                registry.aliases.move(target, PRODUCTION, "bench", "alias visibility", slot=slot)
                returned = time.perf_counter()
            while catalog.alias_target(name, PRODUCTION) != revisions:
                time.sleep(0.001)
            seen = time.perf_counter()
            after_return.append(seen - returned)
            after_start.append(seen - start)
            if catalog.resolve(RevisionRef(name)).id != target:
                raise SystemExit(f"{name}@production resolved elsewhere than {target}")
    finally:
        watcher.stop()
    return after_return, after_start, watcher.sync_s


def main() -> None:
    parser = harness.command_line(__doc__, "catalog")
    parser.add_argument("--adapters", type=int, default=100_000, help="adapters in the index")
    parser.add_argument("--revisions", type=int, default=10, help="revisions per adapter")
    parser.add_argument("--bases", type=int, default=50, help="bases the adapters are on")
    parser.add_argument("--lookups", type=int, default=100_000, help="timed resolves")
    parser.add_argument("--mlflow-adapters", type=int, default=1000)
    parser.add_argument("--mlflow-revisions", type=int, default=10, help="versions per adapter")
    parser.add_argument("--moves", type=int, default=10, help="alias moves timed")
    args = parser.parse_args()

    with harness.scratch("catalog") as (work, services):
        mlflow = harness.start_registry(work / "registry", services)
        run(args, work, mlflow)


def run(args: argparse.Namespace, work: Path, mlflow: ManagedProcess) -> None:
    load_at_start = os.getloadavg()[0]
    registry = Registry(mlflow.url)
    store = LocalArtifactStore(work / "store")
    total = args.adapters * args.revisions

    # Child processes build the million and fill MLflow, side by side; this process's memory
    # stays the catalog's own.
    mlflow_versions = args.mlflow_adapters * args.mlflow_revisions
    database_uri = f"sqlite:///{work / 'registry' / 'mlflow.db'}"
    with ProcessPoolExecutor(2, mp_context=get_context("spawn")) as children:
        building = children.submit(
            build_synthetic, work / "synthetic.sqlite", args.adapters, args.revisions, args.bases
        )
        creating = children.submit(
            create_mlflow_versions, database_uri, args.mlflow_adapters, args.mlflow_revisions, 0
        )
        built, created = building.result(), creating.result()
    rate = mlflow_versions / created["create_s"]
    print(f"created {mlflow_versions:,} versions in MLflow in {created['create_s']:.0f} s "
          f"({rate:.0f}/s)", flush=True)  # fmt: skip
    start = time.perf_counter()
    snapshot = catalog_snapshot.publish(store, work / "synthetic.sqlite")
    publish_s = time.perf_counter() - start
    (work / "synthetic.sqlite").unlink()
    print(f"index of {total:,} revisions over {args.adapters:,} adapters: "
          f"{built['bytes'] / 1e6:.0f} MB, built in {built['build_s']:.0f} s, checked and "
          f"published in {publish_s:.1f} s", flush=True)  # fmt: skip

    harness.evict([store.root / snapshot.name])
    before, before_file = rss(), rss_file()
    start = time.perf_counter()
    catalog = Catalog(registry, base_digest=base_digest(0), folder=work)
    if catalog.start_from_snapshot(store) != snapshot:
        raise SystemExit("the catalog did not start from the published snapshot")
    catalog.resolve(RevisionRef("bench-000000"))
    cold_start_s = time.perf_counter() - start

    refs = lookups(args.lookups, args.adapters, args.revisions, seed=0)
    single = quantiles_us(timed_resolves(catalog, refs))
    # Another uniform mix: not the one just asked, whose answers the catalog keeps.
    uniform = lookups(args.lookups, args.adapters, args.revisions, seed=1)
    threaded_per_s, threaded_samples = threaded_resolves(catalog, uniform)
    threaded = quantiles_us(threaded_samples)
    skewed = lookups(args.lookups, args.adapters, args.revisions, seed=2, zipf_s=ZIPF_S)
    skewed_per_s, skewed_samples = threaded_resolves(catalog, skewed)
    zipf = quantiles_us(skewed_samples)
    hot = quantiles_us(timed_resolves(catalog, refs[:1000] * 10))
    recent_refs = refs[:1000] * max(1, len(refs) // 1000)  # as many resolves as the others
    recent_per_s, recent_samples = threaded_resolves(catalog, recent_refs)
    recent = quantiles_us(recent_samples)
    # After every resolve above: the answers the catalog keeps in memory included.
    catalog_rss, catalog_rss_file = rss() - before, rss_file() - before_file

    # desired(): the index is queried after a change (here: another base each time), and
    # the answer kept until the next one.
    queried_s, kept_s = [], []
    for n in range(20):
        catalog.base_digest = base_digest((n + 1) % 2)  # base 0, the worker's, last
        start = time.perf_counter()
        desired = catalog.desired()
        queried_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        catalog.desired()
        kept_s.append(time.perf_counter() - start)
    catalog.base_digest = None  # as a gateway's catalog, which serves every base
    start = time.perf_counter()
    every_base = catalog.desired()
    desired_every_base_s = time.perf_counter() - start
    catalog.base_digest = base_digest(0)
    print(f"cold start from the snapshot {cold_start_s:.2f} s; resolve (one thread, uniform "
          f"over {total:,}) p50 {single['p50_us']:.1f} us, p99 {single['p99_us']:.1f} us; "
          f"recently used: p99 {hot['p99_us']:.1f} us; catalog RSS "
          f"{catalog_rss / 2**20:.0f} MiB (of it file-backed {catalog_rss_file / 2**20:.0f} "
          "MiB)", flush=True)  # fmt: skip
    print(f"{THREADS} threads, uniform over {total:,} ({len(set(uniform)):,} distinct refs in "
          f"{len(uniform):,}; the catalog keeps at most {HOT_ANSWERS:,} answers): p50 "
          f"{threaded['p50_us']:.1f} us, p99 {threaded['p99_us']:.1f} us, "
          f"{threaded_per_s:,.0f} resolves/s; Zipf s={ZIPF_S} over the adapters "
          f"({len(set(skewed)):,} distinct refs in {len(skewed):,}): p50 {zipf['p50_us']:.1f} "
          f"us, p99 {zipf['p99_us']:.1f} us, {skewed_per_s:,.0f} resolves/s; recently used "
          f"({len(set(recent_refs)):,} refs, {len(recent_refs):,} resolves): p50 "
          f"{recent['p50_us']:.1f} us, p99 {recent['p99_us']:.1f} us, {recent_per_s:,.0f} "
          "resolves/s", flush=True)  # fmt: skip
    print(f"desired() for one base: {len(desired)} revisions; after a change (the index "
          f"queried) {statistics.median(queried_s) * 1000:.2f} ms, else (kept) "
          f"{statistics.median(kept_s) * 1000:.3f} ms (medians of 20); for every base: "
          f"{len(every_base):,} in {desired_every_base_s * 1000:.0f} ms", flush=True)  # fmt: skip

    fresh = Catalog(registry, base_digest=base_digest(0), folder=work)
    start = time.perf_counter()
    fresh.sync()
    full_sync_s = time.perf_counter() - start
    synced = check(fresh.index_path).revisions
    if synced != mlflow_versions:
        raise SystemExit(f"the full sync holds {synced} of the {mlflow_versions} versions")
    start = time.perf_counter()
    fresh.sync()
    idle_sync_s = time.perf_counter() - start
    fresh.close()
    print(f"full sync of {mlflow_versions:,} versions: {full_sync_s:.1f} s "
          f"({mlflow_versions / full_sync_s:,.0f} versions/s); a sync with nothing new "
          f"{idle_sync_s * 1000:.0f} ms", flush=True)  # fmt: skip

    seen, seen_from_start, watcher_sync_s = alias_moves(
        catalog, registry, args.moves, args.mlflow_revisions
    )
    print(f"alias moves seen by the million catalog (sync every {SYNC_INTERVAL_S:.0f} s), after "
          f"the move returned: median {statistics.median(seen):.2f} s, max {max(seen):.2f} s; "
          f"after it started: median {statistics.median(seen_from_start):.2f} s, max "
          f"{max(seen_from_start):.2f} s ({len(seen)} moves)")  # fmt: skip
    first_round_s, round_ms = watcher_sync_s[0], statistics.median(watcher_sync_s[1:]) * 1000
    print(f"the watcher's first round, catching up with the {args.mlflow_adapters} adapters "
          f"changed since the snapshot: {first_round_s:.2f} s; later rounds {round_ms:.0f} ms "
          "(median)")  # fmt: skip
    end_rss = rss() - before
    catalog.close()

    result: dict[str, Any] = {
        "revisions": total,
        "adapters": args.adapters,
        "bases": args.bases,
        "index_bytes": built["bytes"],
        "build_s": built["build_s"],
        "publish_s": publish_s,
        "cold_start_s": cold_start_s,
        "resolve_p50_us": single["p50_us"],
        "resolve_p99_us": single["p99_us"],
        "resolve_max_us": single["max_us"],
        "resolve_lookups": len(refs),
        "resolve_threads": THREADS,
        "resolve_threaded_p50_us": threaded["p50_us"],
        "resolve_threaded_p99_us": threaded["p99_us"],
        "resolve_threaded_per_s": threaded_per_s,
        "resolve_threaded_workload": "uniform over every adapter, another draw than one thread's",
        "resolve_threaded_distinct_refs": len(set(uniform)),
        "resolve_kept_answers_max": HOT_ANSWERS,
        "resolve_zipf_s": ZIPF_S,
        "resolve_zipf_distinct_refs": len(set(skewed)),
        "resolve_zipf_p50_us": zipf["p50_us"],
        "resolve_zipf_p99_us": zipf["p99_us"],
        "resolve_zipf_per_s": skewed_per_s,
        "resolve_recent_threaded_p50_us": recent["p50_us"],
        "resolve_recent_threaded_p99_us": recent["p99_us"],
        "resolve_recent_threaded_per_s": recent_per_s,
        "resolve_recent_p50_us": hot["p50_us"],
        "resolve_recent_p99_us": hot["p99_us"],
        "catalog_rss_mb": catalog_rss / 2**20,
        "catalog_rss_file_mb": catalog_rss_file / 2**20,
        "catalog_rss_end_mb": end_rss / 2**20,
        "desired_revisions": len(desired),
        "desired_ms": statistics.median(kept_s) * 1000,
        "desired_after_change_ms": statistics.median(queried_s) * 1000,
        "desired_every_base_revisions": len(every_base),
        "desired_every_base_ms": desired_every_base_s * 1000,
        "mlflow_versions": mlflow_versions,
        "mlflow_create_s": created["create_s"],
        "sync_full_s": full_sync_s,
        "sync_versions_per_s": mlflow_versions / full_sync_s,
        "sync_idle_ms": idle_sync_s * 1000,
        "sync_interval_s": SYNC_INTERVAL_S,
        "alias_visible_s": statistics.median(seen),
        "alias_visible_max_s": max(seen),
        "alias_visible_samples_s": seen,
        "alias_visible_from_move_start_s": statistics.median(seen_from_start),
        "alias_visible_from_move_start_max_s": max(seen_from_start),
        "alias_visible_from_move_start_samples_s": seen_from_start,
        "watcher_round_ms": round_ms,
        "watcher_first_round_s": first_round_s,
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_1m_at_start": load_at_start,
            "load_average_1m_at_end": os.getloadavg()[0],
        },
    }
    harness.write(args.out, result)


if __name__ == "__main__":
    main()
