"""A worker in this process, over a registry of its own (no alias there, so it admits only what
a test asks for): the host tier has one owner, so a prewarm that does not fit leaves nothing
behind; and `request_path_loads` counts the loads a user's request waits for, wherever they
happen."""

import dataclasses
import gc
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from control.services import start_mlflow
from mint_core.artifacts.stores import open_store
from mint_core.catalog.catalog import Catalog
from mint_core.config import MintConfig
from mint_core.model.base import BaseModel, load_base
from mint_core.registry import Registry
from mint_core.revisions import RevisionId
from mint_core.states import Readiness
from serving.backends.embedded import EmbeddedBackend
from serving.engine.engine import AdapterWeights, TorchEngine
from serving.engine.sampling import SamplingParams
from serving.worker import prewarm
from serving.worker.worker import ReadinessEntry, Worker
from tests.integration.helpers import register_random_adapter

pytestmark = pytest.mark.slow

SETTLED = (Readiness.READY, Readiness.FAILED)


@pytest.fixture(scope="module")
def own_registry(
    config: MintConfig, base: BaseModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[MintConfig]:
    """The session's configuration over an MLflow server of its own."""
    mlflow = start_mlflow(tmp_path_factory.mktemp("tiers-registry"))
    yield dataclasses.replace(config, tracking_uri=mlflow.url)
    mlflow.stop()


@contextmanager
def worker_for(config: MintConfig, slots: int, host_cache_bytes: int) -> Iterator[Worker]:
    engine = TorchEngine(load_base(config.base, config.home), slots=slots)
    catalog = Catalog(Registry(config.tracking_uri))
    backend = EmbeddedBackend(engine, host_cache_bytes)
    worker = Worker(backend, catalog, open_store(config), sync_interval_s=3600).start()
    try:
        yield worker
    finally:
        worker.close()


def settle(worker: Worker, revision: RevisionId, timeout_s: float = 120) -> ReadinessEntry:
    """`revision`'s entry once its prewarm has ended, ready or failed."""
    deadline = time.monotonic() + timeout_s
    while (entry := worker.readiness(revision)).state not in SETTLED:
        assert time.monotonic() < deadline, f"{revision} still {entry.state}"
        time.sleep(0.05)
    return entry


def test_a_prewarm_that_does_not_fit_the_host_cache_leaves_nothing_behind(
    own_registry: MintConfig, base: BaseModel, tmp_path: Path
) -> None:
    revision = register_random_adapter(own_registry, base, "too-big", tmp_path / "a", seed=3)
    # A log record would hold the prewarm's exception, and through its traceback the weights,
    # for as long as pytest keeps it: this test looks for the weights themselves.
    logging.disable(logging.CRITICAL)
    try:
        with worker_for(own_registry, slots=2, host_cache_bytes=1000) as worker:
            worker.admit(revision)
            entry = settle(worker, revision)
            assert entry.state is Readiness.FAILED
            assert entry.reason is not None
            assert f"{revision} needs" in entry.reason
            assert "raise the host cache capacity" in entry.reason
            assert worker.residency.host_table() == []
            assert worker.residency.slot_table() == []
            assert worker.residency.host_bytes == 0
            assert worker.backend.engine.adapters == frozenset()
        # The worker is closed (its threads have ended): nothing but it could hold the weights.
        gc.collect()
        kept = [o for o in gc.get_objects() if type(o) is AdapterWeights]
        assert [w.key for w in kept if w.key == str(revision)] == []
    finally:
        logging.disable(logging.NOTSET)


def test_request_path_loads_counts_what_a_users_request_waited_for(
    own_registry: MintConfig, base: BaseModel, tmp_path: Path
) -> None:
    first, second = (
        register_random_adapter(own_registry, base, f"tenant-{n}", tmp_path / str(n), seed=n)
        for n in (1, 2)
    )
    with worker_for(own_registry, slots=1, host_cache_bytes=1 << 30) as worker:
        for revision in (first, second):
            worker.admit(revision)
            assert settle(worker, revision).state is Readiness.READY
        # Prewarm fetched both and copied each into the one slot: none of that counts.
        assert worker.residency.slot_table()[0].key == str(second)
        assert worker.request_path_loads == 0

        # A user's request for the first waits for its copy into the slot; then it is a hit.
        params = SamplingParams(max_new_tokens=2)
        prompt = worker.backend.engine.codec.encode("abc=")
        for loads in (1, 1):
            worker.generate(prompt, str(first), params).result(timeout_s=60)
            assert worker.request_path_loads == loads
        # A fetch from a request's thread (the readiness gate never makes one) counts too.
        worker._prewarm.fetch(worker.catalog.record(first).artifact_uri)
        assert worker.request_path_loads == 2


def test_a_warm_up_that_fails_leaves_nothing_in_the_host_cache(
    own_registry: MintConfig, base: BaseModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Phase 1 took the weights into the host tier; the warm-up generation of phase 2 then
    times out on a stuck engine, still pinning its slot. Once the engine moves again, nothing
    of the failed revision is held anywhere."""
    revision = register_random_adapter(own_registry, base, "stuck", tmp_path / "a", seed=5)
    # Long enough for the warm-up to have joined the batch (and pinned its slot) when it ends.
    monkeypatch.setattr(prewarm, "WARMUP_TIMEOUT_S", 5.0)
    with worker_for(own_registry, slots=2, host_cache_bytes=1 << 30) as worker:
        engine = worker.backend.engine
        moving = threading.Event()
        step = engine.step

        def stuck(*args: object, **kwargs: object) -> object:
            moving.wait(timeout=120)
            return step(*args, **kwargs)

        monkeypatch.setattr(engine, "step", stuck)
        worker.admit(revision)
        entry = settle(worker, revision)
        assert entry.state is Readiness.FAILED
        assert entry.reason is not None and "the engine is stuck" in entry.reason
        assert [e.key for e in worker.residency.slot_table()] == [str(revision)]  # pinned

        moving.set()
        deadline = time.monotonic() + 60
        while worker.residency.host_table() or worker.residency.slot_table():
            assert time.monotonic() < deadline, worker.residency.host_table()
            time.sleep(0.05)
        assert worker.residency.host_bytes == 0
        assert engine.adapters == frozenset()
