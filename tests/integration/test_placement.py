"""Placement and demand admission on a fleet of two worker processes behind a gateway, over 40
production adapters and a host tier of 8 revisions per worker: each revision is held by its
placement, a cold one answers "not ready" at once and then its exact tokens, the host tier never
holds more than its bound, a release waits for its placement only, and a killed worker's
revisions come back on the other by demand. Nothing is ever loaded on a request's path."""

import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from peft import LoraConfig

from control.services import start_mlflow
from control.status import worker_rows
from mint_core.config import LOOPBACK, MintConfig
from mint_core.model.base import BaseModel
from mint_core.model.generate import greedy_generate
from mint_core.planning.placement import place
from mint_core.registry import Registry
from mint_core.revisions import PRODUCTION, RevisionId
from mint_core.states import Readiness, Stage
from processes import ManagedProcess, free_port, stop_all
from serving.gateway import WORKER_HEADER, start_gateway
from serving.http.client import WorkerClient
from serving.worker.server import start_worker
from tasks.pipeline import admit_revision, rollout_lock
from tests.helpers import random_lora, wait_until
from tests.integration.helpers import activate, pause_s, register_random_adapter

pytestmark = pytest.mark.slow

ADAPTERS = 40
HOST_BOUND = 8
PROMPT = "hello="
NEW_TOKENS = 6
NOT_READY_ANSWERS = 60
"""Most "not ready" answers `until_answered` takes for one revision. Each is followed by the
pause it asks for, at most LONGEST_PAUSE_S: the worker's estimate from its recent prewarms,
which grows as one runs late, so a slow prewarm on a loaded machine is asked about once a second
and 60 answers outlast one of a minute (a quick one, many prewarms' worth), however slow each
request is."""
LONGEST_PAUSE_S = 1.0
"""Longest pause after a "not ready" answer: on a loaded machine the worker's estimate follows
its slowest recent prewarms, and the answer is wanted as soon as the revision is ready."""
BUSY_NOT_READY_ANSWERS = 120
"""As NOT_READY_ANSWERS, twice over, where a revision waits its turn behind others: four clients
over all 40 adapters (each worker evicting as it goes), or a killed worker's revisions admitted
by demand on the survivor once it has counted the victim gone."""
CLIENT_TIMEOUT_S = 30.0
"""The kill test's clients' request timeout."""
ROUND_S = 3 * (CLIENT_TIMEOUT_S + 1.0)
"""Longest a kill test client takes over its three adapters (each request within
CLIENT_TIMEOUT_S, and a pause of at most a second after a "not ready" one): the bound on
waiting for its outcomes."""
MEMBERS_SETTLE_S = 30.0
"""Longest the survivor takes to count a killed worker gone: MISSES_TO_LEAVE syncs, each 0.5 s
apart when idle but one behind another's admissions on a loaded machine (CI's 2 cores: the kill
test ended before the third)."""


@dataclasses.dataclass
class Placed:
    """The fleet under test, and what the tests saw of it."""

    config: MintConfig
    base: BaseModel
    workers: list[ManagedProcess]
    gateway: ManagedProcess
    names: list[str]
    folder: Path
    peak_host: dict[str, int] = dataclasses.field(default_factory=dict)
    """Most revisions each worker's host tier held at any sample."""

    def placement(self, revision: RevisionId) -> str:
        live = [w.url for w in self.workers if w.process.poll() is None]
        return place(str(revision), live)[0]

    def ready_on(self, revision: RevisionId) -> list[str]:
        return [
            w.url
            for w in self.workers
            if w.process.poll() is None
            and WorkerClient(w.url).readiness(revision)[0] is Readiness.READY
        ]

    def reference(self, seed: int) -> list[int]:
        """The tokens adapter number `seed` answers alone, computed by PEFT in this process."""
        model = random_lora(self.base.model, lora_of(seed), seed, std=0.3)
        prompt = self.base.codec.encode(PROMPT)
        return list(greedy_generate(model, self.base.codec, [prompt], NEW_TOKENS)[0].token_ids)


def lora_of(seed: int) -> LoraConfig:
    rank = 1 + seed % 8  # as register_random_adapter makes it
    return LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj", "up_proj"])


def generate(url: str, model: str, timeout_s: float = 60.0) -> httpx.Response:
    body = {
        "inputs": PROMPT,
        "parameters": {"adapter_id": model, "max_new_tokens": NEW_TOKENS, "details": True},
    }
    return httpx.post(url + "/generate", json=body, timeout=timeout_s)


def until_answered(
    url: str, model: str, not_ready_answers: int = NOT_READY_ANSWERS
) -> tuple[httpx.Response, int]:
    """Ask as a client that honours `Retry-After-Ms` does, until an answer that is not "not
    ready"; that answer and the number of "not ready" answers before it (at most
    `not_ready_answers`)."""
    waits = 0
    while True:
        response = generate(url, model)
        if response.status_code != 503 or response.json()["error_type"] != "not_ready":
            return response, waits
        waits += 1
        assert waits <= not_ready_answers, f"{model} still not ready: {response.text}"
        time.sleep(pause_s(response, LONGEST_PAUSE_S))


def tokens(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return [token["id"] for token in response.json()["details"]["tokens"]]


@pytest.fixture(scope="module")
def placed(
    config: MintConfig,
    base: BaseModel,
    tmp_path_factory: pytest.TempPathFactory,
    prefect_api: str,
) -> Iterator[Placed]:
    """40 production adapters in a registry of their own; two workers (host tier of 8
    revisions, 8 device slots) that name each other in MINT_WORKER_URLS; a gateway."""
    folder = tmp_path_factory.mktemp("placement")
    mlflow = start_mlflow(folder / "registry")
    services: list[ManagedProcess] = [mlflow]
    try:
        ports = [free_port(), free_port()]
        urls = tuple(f"http://{LOOPBACK}:{port}" for port in ports)
        fleet_config = dataclasses.replace(
            config,
            tracking_uri=mlflow.url,
            worker_urls=urls,
            api_keys={},
            worker_api_key="",
            host_adapters=HOST_BOUND,
            device_slots=HOST_BOUND,
            sync_interval_s=0.5,
        )
        registry = Registry(mlflow.url)
        names = [f"tenant-{n:02d}" for n in range(ADAPTERS)]
        for seed, name in enumerate(names):
            revision = register_random_adapter(fleet_config, base, name, folder / name, seed)
            registry.stages.set(revision, Stage.ADMITTED)  # as a roll-out's admit step leaves it
            with rollout_lock(name) as slot:
                registered = registry.revisions.get(revision)
                registry.aliases.activate(
                    registered, PRODUCTION, "tests", "placement test", slot=slot
                )
        with ThreadPoolExecutor(2) as pool:
            starting = [pool.submit(start_worker, fleet_config, port) for port in ports]
            workers = [future.result() for future in starting]
        services += workers
        gateway = start_gateway(fleet_config)
        services.append(gateway)
        fleet = Placed(fleet_config, base, workers, gateway, names, folder)
        sampling = threading.Event()
        sampler = threading.Thread(target=sample_host_tiers, args=(fleet, sampling), daemon=True)
        sampler.start()
        yield fleet
        sampling.set()
        sampler.join(timeout=10)
    finally:
        stop_all(services)


def sample_host_tiers(fleet: Placed, stop: threading.Event) -> None:
    """Record the most revisions each worker's host tier holds, every 50 ms, all along."""
    with httpx.Client(timeout=5) as http:
        while not stop.wait(0.05):
            for worker in fleet.workers:
                try:
                    held = http.get(worker.url + "/health").json()["tiers"]["host"]["revisions"]
                except (httpx.HTTPError, KeyError, ValueError):
                    continue  # killed, or busy: the next sample
                fleet.peak_host[worker.url] = max(fleet.peak_host.get(worker.url, 0), held)


def test_each_worker_prefills_only_what_is_placed_on_it_and_fits(placed: Placed) -> None:
    deadline = time.monotonic() + 120
    while True:  # a revision is in the host tier before its prewarm makes it ready
        health = [WorkerClient(w.url).health() for w in placed.workers]
        held = [h["tiers"]["host"]["revisions"] for h in health]  # type: ignore[index]
        ready = [httpx.get(w.url + "/admin/routing").json()["ready"] for w in placed.workers]
        settled = all(n == HOST_BOUND for n in held + [len(r) for r in ready])
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert held == [HOST_BOUND, HOST_BOUND]
    for worker, revisions in zip(placed.workers, ready, strict=True):
        assert len(revisions) == HOST_BOUND
        for revision in revisions:
            adapter, _, number = revision.partition(":r")
            assert placed.placement(RevisionId(adapter, int(number))) == worker.url
    rows = worker_rows(placed.config)
    assert rows[0][3:5] == ["host tier", "device tier"]
    assert all(row[3].startswith(f"{HOST_BOUND}/{HOST_BOUND} hits") for row in rows[1:]), rows


def test_a_cold_adapter_is_not_ready_at_once_then_answers_its_exact_tokens(
    placed: Placed,
) -> None:
    ready = {r for w in placed.workers for r in httpx.get(w.url + "/admin/routing").json()["ready"]}
    cold = [(seed, n) for seed, n in enumerate(placed.names) if f"{n}:r1" not in ready][:3]
    assert len(cold) == 3
    for seed, name in cold:
        started = time.monotonic()
        response = generate(placed.gateway.url, f"{name}@production")
        elapsed = time.monotonic() - started
        assert response.status_code == 503, response.text
        body = response.json()
        assert body["error_type"] == "not_ready" and body["id"] == f"{name}:r1", body
        assert elapsed < 0.5, elapsed
        assert int(response.headers["Retry-After"]) >= 1
        assert 0 < int(response.headers["Retry-After-Ms"]) <= 5000
        placement = placed.placement(RevisionId(name, 1))
        assert response.headers[WORKER_HEADER] == placement  # its placement answered it

        answered, _ = until_answered(placed.gateway.url, f"{name}@production")
        assert answered.headers[WORKER_HEADER] == placement
        assert tokens(answered) == placed.reference(seed)
    # The host tiers were just filled by prefill, which nobody waits for: each cold adapter
    # evicted a prefilled one at its first prewarm, never put off for a full tier (prefilled
    # revisions held fresh kept demand out for FRESH_S, 10 s: the tiers benchmark's stall).
    for worker in placed.workers:
        events = httpx.get(worker.url + "/admin/events").json()["events"]
        put_off = [e for e in events if "does not fit in the host cache" in (e["reason"] or "")]
        assert put_off == [], put_off


def test_traffic_over_every_adapter_keeps_each_host_tier_within_its_bound(
    placed: Placed,
) -> None:
    """Two rounds over all 40 adapters from 4 clients: each worker has 20 placed on it and
    room for 8, so it evicts as it goes; every adapter answers its own tokens."""
    references = {name: placed.reference(seed) for seed, name in enumerate(placed.names[:8])}

    def client(names: list[str]) -> None:
        for name in names:
            answered, _ = until_answered(
                placed.gateway.url, f"{name}@production", BUSY_NOT_READY_ANSWERS
            )
            if name in references:
                assert tokens(answered) == references[name], name
            else:
                assert answered.status_code == 200, answered.text

    order = placed.names * 2
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(client, [order[i::4] for i in range(4)]))
    health = [WorkerClient(w.url).health() for w in placed.workers]
    assert all(h["tiers"]["host"]["evictions"] > 0 for h in health), health  # type: ignore[index]
    assert max(placed.peak_host.values()) <= HOST_BOUND, placed.peak_host
    assert all(h["request_path_loads"] == 0 for h in health), health


def test_a_release_activates_once_its_placement_is_ready_not_every_worker(
    placed: Placed,
) -> None:
    # An adapter whose production revision is ready nowhere now, and whose r2 is placed on
    # one worker: the other is never asked for it.
    registry = Registry(placed.config.tracking_uri)
    ready = {r for w in placed.workers for r in httpx.get(w.url + "/admin/routing").json()["ready"]}
    name = first = next(n for n in placed.names if f"{n}:r1" not in ready)
    r2 = register_random_adapter(placed.config, placed.base, name, placed.folder / f"{name}-2", 100)
    assert r2 == RevisionId(name, 2)
    fleet = admit_revision.fn(placed.config, r2)
    placement = placed.placement(r2)
    assert [w.url for w in fleet.workers] == [placement]
    activate(placed.config, r2, fleet=fleet, timeout_s=60)
    assert registry.revisions.get(r2).aliases == (PRODUCTION,)
    other = next(w for w in placed.workers if w.url != placement)
    assert WorkerClient(other.url).readiness(r2)[0] is Readiness.NOT_ADMITTED
    answered, waits = until_answered(placed.gateway.url, f"{name}@production")
    assert answered.headers["X-Mint-Revision"] == str(r2) and waits == 0

    # Replacing a revision that serves: the new one is made ready where the old one is too.
    name = next(
        n
        for n in placed.names
        if n != first and placed.placement(RevisionId(n, 1)) != placed.placement(RevisionId(n, 2))
    )
    until_answered(placed.gateway.url, f"{name}@production")  # r1 ready on its placement
    old = placed.placement(RevisionId(name, 1))
    r2 = register_random_adapter(placed.config, placed.base, name, placed.folder / f"{name}-2", 200)
    fleet = admit_revision.fn(placed.config, r2)
    assert {w.url for w in fleet.workers} == {w.url for w in placed.workers}
    activate(placed.config, r2, fleet=fleet, timeout_s=60)
    assert set(placed.ready_on(r2)) >= {old, placed.placement(r2)}
    answered, waits = until_answered(placed.gateway.url, f"{name}@production")
    assert answered.headers["X-Mint-Revision"] == str(r2) and waits == 0


def test_a_killed_workers_revisions_come_back_on_the_other_by_demand(placed: Placed) -> None:
    """Four clients over six adapters, three placed on each worker, all ready; one worker is
    killed under them. The requests it had may fail (502 `worker_failed`); every other answer
    is the adapter's, or "not ready" until the survivor has admitted it by demand."""
    victim, survivor = placed.workers
    on = {w.url: [n for n in placed.names if placed.placement(RevisionId(n, 1)) == w.url]
          for w in placed.workers}  # fmt: skip
    moving, staying = on[victim.url][:3], on[survivor.url][:3]
    for name in moving + staying:
        until_answered(placed.gateway.url, f"{name}@production")
    outcomes: list[tuple[int, str, str]] = []
    stop = threading.Event()

    def client(number: int) -> None:
        names = (moving + staying)[number::2]
        while not stop.is_set():
            for name in names:
                if stop.is_set():
                    return
                response = generate(placed.gateway.url, f"{name}@production", CLIENT_TIMEOUT_S)
                kind = response.json().get("error_type", "") if response.status_code != 200 else ""
                outcomes.append((response.status_code, kind, name))
                if response.status_code == 503:
                    time.sleep(pause_s(response, LONGEST_PAUSE_S))

    def answered_each(since: int, statuses: tuple[int, ...]) -> bool:
        """Whether every adapter has an outcome with one of `statuses` from `since` on."""
        return {n for status, _, n in outcomes[since:] if status in statuses} == set(adapters)

    def until(check: Callable[[], bool]) -> None:
        """Poll until `check()` or ROUND_S pass (the caller asserts it); a client that failed
        meanwhile raises its error here."""
        deadline = time.monotonic() + ROUND_S
        while not check() and time.monotonic() < deadline:
            for future in running:
                if future.done():
                    future.result()
            time.sleep(0.05)

    adapters = moving + staying
    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(client, number) for number in range(4)]
        try:  # the clients stop whatever fails here, or leaving the pool would wait for them
            until(lambda: answered_each(0, (200,)))  # every client under way before the kill
            assert answered_each(0, (200,)), outcomes
            os.kill(victim.process.pid, signal.SIGKILL)
            victim.process.wait()
            for name in moving:  # each answers again, from the survivor
                answered, _ = until_answered(
                    placed.gateway.url, f"{name}@production", BUSY_NOT_READY_ANSWERS
                )
                assert answered.headers[WORKER_HEADER] == survivor.url
            moved = len(outcomes)  # and a round of every client's after the move
            until(lambda: answered_each(moved, (200, 503)))
            assert answered_each(moved, (200, 503)), outcomes[moved:]
        finally:
            stop.set()
        for future in running:
            future.result()
    failed = [o for o in outcomes if o[0] not in (200, 503)]
    assert all(o[0] == 502 and o[1] == "worker_failed" for o in failed), failed
    assert len(failed) <= 4, failed  # at most each client's request in flight at the kill
    assert all(o[1] == "not_ready" for o in outcomes if o[0] == 503), outcomes
    # The survivor's own revisions stay placed on it; one may still leave its host tier to make
    # room for a moving one (its tier of 8 is full from the tests before, and LRFU weighs earlier
    # use too, so one of its idle revisions can outscore a busy one), and then it comes back by
    # demand, as the moving ones did.
    for name in staying:
        answered, _ = until_answered(
            placed.gateway.url, f"{name}@production", BUSY_NOT_READY_ANSWERS
        )
        assert answered.headers[WORKER_HEADER] == survivor.url
    assert max(placed.peak_host.values()) <= HOST_BOUND, placed.peak_host
    survivor_client = WorkerClient(survivor.url)
    health = survivor_client.health()
    assert health["request_path_loads"] == 0 and health["request_path_fetches"] == 0, health
    # The survivor answered the moving revisions as soon as the victim failed an ask; it drops
    # the victim from its members once it has missed MISSES_TO_LEAVE health checks, one a sync.
    wait_until(
        lambda: survivor_client.health()["placement"]["members"] == [survivor.url],
        MEMBERS_SETTLE_S,
    )
