"""A fleet of two bases behind one gateway: two workers on base A (the embedded default), one
on base B (a tiny Qwen2), all following one MLflow server. Releases activate after only their
base's workers are ready; the gateway sends each request to a worker of the right base; a
worker asked for another base's revision answers 409; a worker SIGKILLed under load costs the
gateway's clients only the requests it had."""

import dataclasses
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from control.services import start_mlflow
from mint_core.config import MintConfig
from mint_core.model.base import BaseModel, BaseSource, load_base
from mint_core.planning.placement import place, ranking
from mint_core.revisions import RevisionId
from processes import ManagedProcess, stop_all
from serving.gateway import WORKER_HEADER, Fleet, WorkerView, start_gateway
from serving.worker.server import start_worker
from tasks.pipeline import admit_revision, prewarm_revision
from tests.helpers import family_folder
from tests.integration.helpers import activate, register_random_adapter

pytestmark = pytest.mark.slow

PROMPT = "abc="
ANSWER_TIMEOUT_S = 60.0
"""`generate`'s request timeout."""
ROUND_S = 2 * ANSWER_TIMEOUT_S
"""Bound on waiting for the kill test's clients' answers: a client's request under way ends
within ANSWER_TIMEOUT_S, and the one it sends next within another."""


@dataclasses.dataclass
class TwoBases:
    config: MintConfig
    """The control plane's view: every worker, base A's model."""
    config_b: MintConfig
    base_b: BaseModel
    workers_a: list[ManagedProcess]
    worker_b: ManagedProcess
    gateway: ManagedProcess
    folder: Path
    mlflow: ManagedProcess

    def release(self, config: MintConfig, base: BaseModel, name: str, seed: int) -> RevisionId:
        """Register a random adapter on `config`'s base and roll it out with every worker of
        the fleet named: the pipeline picks those of its base."""
        revision = register_random_adapter(config, base, name, self.folder / name, seed)
        fleet = dataclasses.replace(config, worker_urls=self.config.worker_urls)
        admit_revision.fn(fleet, revision)
        prewarm_revision.fn(fleet, revision)
        activate(fleet, revision)
        return revision


def generate(url: str, model: str | None, key: str = "key-admin") -> httpx.Response:
    body = {"inputs": PROMPT, "parameters": {"adapter_id": model, "max_new_tokens": 6}}
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(url + "/generate", json=body, headers=headers, timeout=ANSWER_TIMEOUT_S)


@pytest.fixture(scope="module")
def two_bases(
    config: MintConfig, base: BaseModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TwoBases]:
    home = tmp_path_factory.mktemp("two-bases")
    mlflow = start_mlflow(home / "registry")
    config_a = dataclasses.replace(
        config, tracking_uri=mlflow.url, admission_k=1, sync_interval_s=0.5, device_slots=4
    )
    base_b_folder = family_folder("qwen2", home / "bases")
    config_b = dataclasses.replace(config_a, base=BaseSource(str(base_b_folder)))
    base_b = load_base(config_b.base, config.home)
    started: list[ManagedProcess] = [mlflow]
    try:
        workers_a = [start_worker(config_a), start_worker(config_a)]
        started += workers_a
        worker_b = start_worker(config_b)
        started.append(worker_b)
        urls = (*(w.url for w in workers_a), worker_b.url)
        # Every revision of base A on both of its workers (the workers, not named in the
        # list, hold everything: the pipeline waits for both).
        fleet_config = dataclasses.replace(config_a, worker_urls=urls, replicas=2)
        gateway = start_gateway(fleet_config)
        started.append(gateway)
        yield TwoBases(
            fleet_config, config_b, base_b, workers_a, worker_b, gateway, home / "adapters", mlflow
        )
    finally:
        stop_all(started)


@pytest.fixture(scope="module")
def released(two_bases: TwoBases, base: BaseModel) -> dict[str, RevisionId]:
    fleet = two_bases
    return {
        "a": fleet.release(fleet.config, base, "on-a", seed=1),
        "b": fleet.release(fleet.config_b, fleet.base_b, "on-b", seed=2),
    }


def events(worker: ManagedProcess) -> list[dict[str, object]]:
    answer = httpx.get(worker.url + "/admin/events", headers={"Authorization": "Bearer key-admin"})
    return answer.json()["events"]


def test_each_release_activates_on_its_base_workers_only(
    two_bases: TwoBases, released: dict[str, RevisionId]
) -> None:
    # Activation waited only for the workers of each revision's base: a wait for the other
    # base's worker would have failed ("not admitted"), and the release with it.
    for worker in two_bases.workers_a:
        seen = {e["id"] for e in events(worker)}
        assert str(released["a"]) in seen and str(released["b"]) not in seen
    seen = {e["id"] for e in events(two_bases.worker_b)}
    assert str(released["b"]) in seen and str(released["a"]) not in seen


def test_the_gateway_answers_each_request_from_a_worker_of_its_base(
    two_bases: TwoBases, released: dict[str, RevisionId]
) -> None:
    fleet = two_bases
    urls_a = {w.url for w in fleet.workers_a}
    expected = {
        "on-a@production": (fleet.workers_a[0], urls_a, "on-a:r1"),
        "on-b@production": (fleet.worker_b, {fleet.worker_b.url}, "on-b:r1"),
        "on-b:r1": (fleet.worker_b, {fleet.worker_b.url}, "on-b:r1"),
    }
    for model, (direct, workers, revision) in expected.items():
        alone = generate(direct.url, model)
        assert alone.status_code == 200, alone.text
        for _ in range(3):
            routed = generate(fleet.gateway.url, model)
            assert routed.status_code == 200, routed.text
            assert routed.headers["X-Mint-Revision"] == revision
            assert routed.headers[WORKER_HEADER] in workers
            assert routed.json()["generated_text"] == alone.json()["generated_text"]

    # OpenAI's shape, streamed, through the gateway: the same text as one request alone.
    body = {"model": "on-b@production", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    admin = {"Authorization": "Bearer key-admin"}
    alone = httpx.post(fleet.worker_b.url + "/v1/completions", json=body, headers=admin, timeout=60)
    streamed = body | {"stream": True}
    url = fleet.gateway.url + "/v1/completions"
    with httpx.stream("POST", url, json=streamed, headers=admin, timeout=60) as stream:
        assert stream.status_code == 200
        assert stream.headers[WORKER_HEADER] == fleet.worker_b.url
        chunks = [
            json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")
        ]
    text = "".join(chunk["choices"][0]["text"] for chunk in chunks)
    assert text == alone.json()["choices"][0]["text"]

    # The caller's key goes through: an unknown one is refused by the worker, as if direct.
    assert generate(fleet.gateway.url, "on-a@production", key="nobody").status_code == 401
    # The models: both bases and both revisions; naming no base is ambiguous here.
    listed = httpx.get(
        fleet.gateway.url + "/v1/models", headers={"Authorization": "Bearer key-admin"}
    )
    ids = {m["id"] for m in listed.json()["data"]}
    assert {"on-a:r1", "on-b:r1"} <= ids and len(ids) == 4
    assert generate(fleet.gateway.url, None).status_code == 422


def test_feedback_through_the_gateway_reaches_the_worker_that_answered(
    two_bases: TwoBases, released: dict[str, RevisionId]
) -> None:
    fleet = two_bases
    admin = {"Authorization": "Bearer key-admin"}
    # Base B's worker is the fleet's last: base A's workers are asked first, and answer 404.
    answered = generate(fleet.gateway.url, "on-b@production")
    assert answered.headers[WORKER_HEADER] == fleet.worker_b.url
    request_id = answered.headers["X-Mint-Request-Id"]
    body = {"request_id": request_id, "score": 0.5}
    url = fleet.gateway.url + "/v1/feedback"
    scored = httpx.post(url, json=body, headers=admin, timeout=60)
    assert scored.status_code == 200, scored.text
    assert scored.headers[WORKER_HEADER] == fleet.worker_b.url
    assert scored.json() == {"request_id": request_id, "revision": "on-b:r1", "score": 0.5}
    outcomes = httpx.get(fleet.worker_b.url + "/admin/outcomes", headers=admin).json()
    assert outcomes["revisions"]["on-b:r1"]["feedback"] == 1
    again = httpx.post(url, json=body, headers=admin, timeout=60)
    assert again.status_code == 422
    assert "scored already" in again.json()["error"]
    unknown = httpx.post(url, json=body | {"request_id": "gen-0"}, headers=admin, timeout=60)
    assert unknown.status_code == 404
    assert "'gen-0' is not one this worker answered" in unknown.json()["error"]


def test_a_worker_refuses_another_bases_revision_with_409(
    two_bases: TwoBases, released: dict[str, RevisionId]
) -> None:
    refused = generate(two_bases.worker_b.url, "on-a@production")
    assert refused.status_code == 409, refused.text
    message = refused.json()["error"]
    a_digest = httpx.get(two_bases.workers_a[0].url + "/health").json()["base_digest"]
    b_digest = httpx.get(two_bases.worker_b.url + "/health").json()["base_digest"]
    assert a_digest in message and b_digest in message
    admit = httpx.post(
        two_bases.worker_b.url + "/admin/admit",
        json={"adapter": "on-a", "revision": 1},
        headers={"Authorization": "Bearer key-admin"},
    )
    assert admit.status_code == 409, admit.text
    assert str(released["a"]) not in {e["id"] for e in events(two_bases.worker_b)}


def test_routing_prefers_ready_then_placed_then_a_device_slot_then_the_least_busy() -> None:
    def view(url: str, ready: set[str], slots: set[str], in_flight: int) -> WorkerView:
        worker = WorkerView(url)
        routing = {"base_model": "m", "base_digest": "d", "ready": sorted(ready),
                   "device_slots": sorted(slots), "in_flight": 0}  # fmt: skip
        worker.update(routing)
        worker.in_flight = in_flight
        return worker

    fleet = Fleet([
        view("cold", set(), set(), 0),
        view("busy-slot", {"x:r1"}, {"x:r1"}, 5),
        view("idle-host", {"x:r1"}, set(), 0),
        view("idle-slot", {"x:r1"}, {"x:r1"}, 1),
    ])  # fmt: skip
    fleet.workers.append(WorkerView("down"))  # never heard from: not routed to
    every = fleet.choices("x:r1", "d", replicas=4)  # placed on all four
    assert [w.url for w in every.workers] == ["idle-slot", "busy-slot", "idle-host", "cold"]
    assert [w.url for w in every.unready_placement] == ["cold"]  # asked to admit it

    # Placed on one worker: a ready one of the placement before other ready ones.
    placed = place("x:r1", ["cold", "busy-slot", "idle-host", "idle-slot"])[0]
    one = [w.url for w in fleet.choices("x:r1", "d", replicas=1).workers]
    if placed != "cold":
        assert one[0] == placed
    assert one[-1] == "cold"

    # Ready nowhere: the placement first, then the rest in the revision's ranking.
    order = [w.url for w in fleet.choices("y:r1", "d", replicas=1).workers]
    assert order == ranking("y:r1", ["cold", "busy-slot", "idle-host", "idle-slot"])


def test_a_worker_killed_under_load_costs_only_its_requests_in_flight(
    two_bases: TwoBases, released: dict[str, RevisionId]
) -> None:
    fleet = two_bases
    victim, survivor = fleet.workers_a
    results: list[tuple[float, float, int, str, str]] = []
    stop = threading.Event()
    lock = threading.Lock()

    def client() -> None:
        while not stop.is_set():
            started = time.monotonic()
            answer = generate(fleet.gateway.url, "on-a@production")
            ended = time.monotonic()
            with lock:
                results.append((started, ended, answer.status_code,
                                answer.headers.get(WORKER_HEADER, ""), answer.text))  # fmt: skip

    def until(check: Callable[[list[tuple[float, float, int, str, str]]], bool]) -> None:
        """Poll the results until `check` holds of them or ROUND_S pass; the assertions after
        say which."""
        deadline = time.monotonic() + ROUND_S
        while time.monotonic() < deadline:
            with lock:
                if check(list(results)):
                    return
            time.sleep(0.05)

    clients = [threading.Thread(target=client) for _ in range(4)]
    for thread in clients:
        thread.start()
    try:
        until(lambda seen: {r[3] for r in seen} >= {victim.url, survivor.url})  # both served
        killed_at = time.monotonic()
        os.kill(victim.process.pid, signal.SIGKILL)
        # SIGKILL is delivered asynchronously: until the kernel has torn the worker down
        # (reaped), a request the gateway sends on a pooled connection can still reach it and
        # be reset.
        victim.process.wait(timeout=30)
        gone_at = time.monotonic()
        until(lambda seen: len([r for r in seen if r[0] > gone_at]) >= 4)
    finally:  # whatever failed above, the clients stop
        stop.set()
        for thread in clients:
            thread.join(timeout=ANSWER_TIMEOUT_S)

    before = [r for r in results if r[1] < killed_at]
    after = [r for r in results if r[0] > gone_at]
    failed = [r for r in results if r[2] != 200]
    assert {r[3] for r in before} == {victim.url, survivor.url}  # both served before the kill
    assert len(failed) <= len(clients), failed  # at most the requests it had
    for started, _, status, worker, text in failed:
        assert started < gone_at and status == 502 and worker == victim.url, text
        assert httpx.Response(502, content=text).json()["error_type"] == "worker_failed"
    assert len(after) >= 4 and all(r[2] == 200 and r[3] == survivor.url for r in after), after
