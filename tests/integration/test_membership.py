"""A serving worker joins and leaves a fleet with nothing restarted (MINT_FLEET=registry): two
workers and a gateway run over a registry with MinT's accounts; a third worker announces itself
(its heartbeat, with the worker account, in experiment `mint-fleet`: the one thing that account
may write); the pipeline's fleet, the other workers and the gateway take it in, and only the
revisions now placed on it move; stopped, it is gone at the next read."""

import dataclasses
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from control.services import start_mlflow
from mint_core.config import LOOPBACK, MintConfig
from mint_core.membership import FleetSource, FleetWatch, current_fleet
from mint_core.model.base import BaseModel
from mint_core.planning.placement import place
from mint_core.registry import Registry
from mint_core.registry.members import SEQ_TAG
from mint_core.registry_accounts import FLEET, Account, RegistryAccounts
from mint_core.revisions import PRODUCTION, RevisionId
from mint_core.states import Stage
from processes import ManagedProcess, free_port, stop_all
from serving.gateway import WORKER_HEADER, start_gateway
from serving.worker.server import start_worker
from tasks.fleet import resolve_fleet
from tasks.pipeline import rollout_lock
from tests.integration.helpers import pause_s, register_random_adapter

WATCH = FleetWatch(FleetSource.REGISTRY, heartbeat_s=0.5, stale_s=2.5, forget_s=30.0)


@dataclasses.dataclass
class Fleet:
    config: MintConfig
    """The fleet's settings: the first two workers as seeds, MINT_FLEET=registry."""
    accounts: RegistryAccounts
    workers: list[ManagedProcess]
    gateway: ManagedProcess
    joiner_port: int
    revisions: dict[str, RevisionId]
    """Each revision by where it is placed once the third worker has joined: `moves` (to the
    joiner), `stays` (on one of the first two)."""


def acting_as(monkeypatch: pytest.MonkeyPatch, account: Account) -> None:
    for name, value in account.env().items():
        monkeypatch.setenv(name, value)


def _names(urls: tuple[str, ...], joiner: str) -> dict[str, str]:
    """An adapter name that the joiner takes over and one that stays where it is."""
    found: dict[str, str] = {}
    for n in range(1000):
        name = f"member-{n}"
        key = "moves" if place(f"{name}:r1", [*urls, joiner])[0] == joiner else "stays"
        found.setdefault(key, name)
        if len(found) == 2:
            return found
    raise AssertionError("no names found")


@pytest.fixture(scope="module")
def fleet(
    config: MintConfig,
    base: BaseModel,
    tmp_path_factory: pytest.TempPathFactory,
    prefect_api: str,
) -> Iterator[Fleet]:
    folder = tmp_path_factory.mktemp("membership")
    accounts = RegistryAccounts.generate()
    mlflow = start_mlflow(folder / "registry", accounts=accounts)
    services: list[ManagedProcess] = [mlflow]
    patch = pytest.MonkeyPatch()
    try:
        ports = [free_port(), free_port()]
        joiner_port = free_port()
        urls = tuple(f"http://{LOOPBACK}:{port}" for port in ports)
        fleet_config = dataclasses.replace(
            config,
            tracking_uri=mlflow.url,
            worker_urls=urls,
            api_keys={},
            worker_api_key="",
            sync_interval_s=0.5,
            fleet=WATCH,
        )
        reading = accounts.worker.env()
        with ThreadPoolExecutor(3) as pool:
            starting = [
                pool.submit(start_worker, fleet_config, port, env=reading) for port in ports
            ]
            gateway = pool.submit(start_gateway, fleet_config, env=reading)
            acting_as(patch, accounts.pipeline)  # while they start: the adapters
            revisions = {}
            names = _names(urls, f"http://{LOOPBACK}:{joiner_port}")
            for seed, (key, name) in enumerate(names.items()):
                revision = register_random_adapter(fleet_config, base, name, folder / name, seed)
                registry = Registry(mlflow.url)
                registry.stages.set(revision, Stage.ADMITTED)
                with rollout_lock(name) as slot:
                    registered = registry.revisions.get(revision)
                    registry.aliases.activate(registered, PRODUCTION, "tests", "join", slot=slot)
                revisions[key] = revision
            workers = [future.result() for future in starting]
            services += [*workers, gateway.result()]
        yield Fleet(fleet_config, accounts, workers, gateway.result(), joiner_port, revisions)
    finally:
        patch.undo()
        stop_all(services)


ANSWER_TRIES = 100
"""Most requests `answered_by` sends for one answer. Each 503 is followed by the pause it asks
for, at most LONGEST_PAUSE_S: a "not ready" worker's estimate from its recent prewarms, which
grows as one runs late, so a slow prewarm on a loaded machine is asked about once a second and
100 tries outlast one of a minute and a half, however slow each request is."""
LONGEST_PAUSE_S = 1.0
"""Longest pause between tries: a worker's estimate follows its slowest recent prewarms, and
the answer is wanted as soon as the revision is ready."""


def answered_by(gateway: str, revision: RevisionId) -> str:
    """The worker (`X-Mint-Worker`) that answers `revision`'s adapter through the gateway,
    asking again, as each 503 asks, while it is not ready."""
    body = {"inputs": "hello=", "parameters": {"adapter_id": f"{revision.adapter}@production"}}
    for _ in range(ANSWER_TRIES):
        response = httpx.post(gateway + "/generate", json=body, timeout=30)
        if response.status_code == 200:
            return response.headers[WORKER_HEADER]
        assert response.status_code == 503, response.text
        time.sleep(pause_s(response, LONGEST_PAUSE_S))
    raise AssertionError(f"{revision} never answered in {ANSWER_TRIES} tries: {response.text}")


def until(check: Callable[[], bool], what: str, deadline_s: float = 15.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.2)


def fleet_runs(url: str) -> dict[str, tuple[str, str]]:
    """mint-fleet's runs: URL -> (status, seq), as the admin reads them."""
    client = MlflowClient(url)
    experiment = client.get_experiment_by_name(FLEET)
    assert experiment is not None
    return {
        run.data.tags["mint.member.url"]: (run.info.status, run.data.tags[SEQ_TAG])
        for run in client.search_runs([experiment.experiment_id])
    }


def test_a_worker_joins_and_leaves_with_nothing_restarted(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config, moves, stays = fleet.config, fleet.revisions["moves"], fleet.revisions["stays"]
    first, second = sorted(w.url for w in fleet.workers)
    acting_as(monkeypatch, fleet.accounts.pipeline)
    until(lambda: len(fleet_runs(config.tracking_uri)) == 2, "both workers announce themselves")
    assert current_fleet(config) == (first, second)
    revisions = fleet.revisions.items()
    before = {key: answered_by(fleet.gateway.url, revision) for key, revision in revisions}
    assert before == {key: place(str(revision), [first, second])[0] for key, revision in revisions}

    # The worker account writes its heartbeat and nothing else.
    acting_as(monkeypatch, fleet.accounts.worker)
    with pytest.raises(MlflowException, match="Permission denied"):
        MlflowClient(config.tracking_uri).set_registered_model_tag(moves.adapter, "mint.x", "1")
    acting_as(monkeypatch, fleet.accounts.pipeline)

    # A third worker joins: nobody else is restarted or told.
    joiner = start_worker(config, fleet.joiner_port, env=fleet.accounts.worker.env())
    try:
        third = joiner.url
        # It answers health before its first announcement is written (on a thread of its own,
        # so a slow registry never holds up serving): on a loaded machine that comes later.
        until(
            lambda: current_fleet(config) == tuple(sorted((first, second, third))),
            "the joiner announces itself",
            deadline_s=30,
        )
        assert third in {w.url for w in resolve_fleet(config, moves).workers}
        until(
            lambda: answered_by(fleet.gateway.url, moves) == third,
            "the gateway routes the joiner's share to it",
            deadline_s=30,
        )
        assert answered_by(fleet.gateway.url, stays) == before["stays"]  # nothing else moved
        seq = fleet_runs(config.tracking_uri)[third][1]
        until(lambda: fleet_runs(config.tracking_uri)[third][1] != seq, "the joiner beats")
    finally:
        joiner.stop()

    # Stopped gracefully: its run is FINISHED, and the next read leaves it out.
    assert fleet_runs(config.tracking_uri)[third][0] == "FINISHED"
    assert current_fleet(config) == (first, second)
    until(
        lambda: answered_by(fleet.gateway.url, moves) == before["moves"],
        "the gateway routes its share back",
    )
