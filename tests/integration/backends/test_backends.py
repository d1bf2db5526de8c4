"""The backend contract: whatever runs the model, MinT's own engine or a vLLM server the worker
supervises, a worker serves the same answers behind the same lifecycle.

One fleet of two workers, one per backend (`mixed_fleet`), follows its own MLflow server;
adapters are released through the Prefect flow, whose activation waits for both. Every answer
is checked token for token against `PeftModel.generate` on the revision's frozen files
(greedy). The last test SIGKILLs vLLM under load and watches the worker bring it back.
"""

import copy
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import torch
from peft import PeftModel

from flows.promote import rollback
from mint_core.config import BackendKind
from mint_core.errors import NotFoundError, NotReadyError
from mint_core.model.base import BaseModel
from mint_core.model.toy import held_out_words, prompt_for
from mint_core.registry import ACTIVATED_AT_TAG, Registry
from mint_core.revisions import RevisionId, RevisionRef
from processes import ManagedProcess
from serving.worker.readiness import FIRST_PREWARM_S
from tests.integration.helpers import (
    VLLM_SERVER,
    MixedFleet,
    most_prewarming_at_once,
    pause_s,
    register_random_adapter,
    vllm_sockets,
)
from tests.integration.helpers import toy_release as release

pytestmark = pytest.mark.slow

KINDS = [BackendKind.EMBEDDED, BackendKind.VLLM]
PROMPTS = [prompt_for(word) for word in held_out_words(8)]
NEW_TOKENS = 8
TEAM_A = {"Authorization": "Bearer key-team-a"}
TEAM_B = {"Authorization": "Bearer key-team-b"}
ADMIN = {"Authorization": "Bearer key-admin"}
OPEN, PRIVATE = "echo-bot", "private-bot"
CLIENT_TIMEOUT_S = 60.0
"""The load clients' request timeout."""
RESTART_S = 900.0
"""How long vLLM on CPU may take to start again and prewarm its revisions on a loaded machine:
minutes (its model load and warm-up), and slack."""
SERVE_AGAIN_TRIES = round(RESTART_S / FIRST_PREWARM_S)
"""Most requests sent until vLLM, started again after its EngineCore died, serves. Each refusal
is followed by the pause it asks for: while vLLM is down, `engine_unavailable` asks a second and
a revision dropped with the engine answers `not_ready` asking the worker's average prewarm
(FIRST_PREWARM_S until one is timed). At that pause these tries span RESTART_S, however slow
each request is."""
LONGEST_PAUSE_S = 5.0
"""Longest pause between those tries: a late prewarm's estimate grows with it, and a pause far
past the moment vLLM serves only makes the test slower."""


def peft_answers(base: BaseModel, folder: Path) -> list[list[int]]:
    """Greedy tokens of `PeftModel.generate` for each prompt, through the first EOS."""
    model = PeftModel.from_pretrained(copy.deepcopy(base.model), folder).eval()
    codec, answers = base.codec, []
    for prompt in PROMPTS:
        ids = torch.tensor([codec.encode(prompt)])
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=sorted(codec.eos_ids),
                pad_token_id=codec.pad_id,
            )
        answers.append(out[0, ids.shape[1] :].tolist())
    return answers


def served(worker: ManagedProcess, model: str, prompt: str, headers: dict[str, str]) -> tuple:
    """(X-Mint-Revision, token ids) of one greedy completion; raises for an error status."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
    }
    response = httpx.post(worker.url + "/v1/completions", json=body, headers=headers, timeout=60)
    response.raise_for_status()
    return response.headers["X-Mint-Revision"], response.json()["choices"][0]["token_ids"]


@dataclass
class Scenario:
    fleet: MixedFleet
    expected: dict[str, list[list[int]]]
    """Revision -> PeftModel's answers to PROMPTS."""
    registry: Registry

    def worker(self, kind: BackendKind) -> ManagedProcess:
        return self.fleet.workers[kind]

    def expect(self, base: BaseModel, revision: str) -> list[list[int]]:
        if revision not in self.expected:
            adapter, number = revision.split(":r")
            policy = self.registry.revisions.get(RevisionId(adapter, int(number))).policy
            digest = str(policy.frozen_digest).removeprefix("sha256:")
            frozen = self.fleet.config.frozen_root / digest
            self.expected[revision] = peft_answers(base, frozen)
        return self.expected[revision]

    def check_answers(self, kind: BackendKind, model: str, revision: str) -> None:
        worker = self.worker(kind)
        answers = [served(worker, model, prompt, TEAM_A) for prompt in PROMPTS]
        assert {header for header, _ in answers} == {revision}
        assert [tokens for _, tokens in answers] == self.expected[revision], (kind, revision)


@pytest.fixture(scope="module")
def scenario(mixed_fleet: MixedFleet, base: BaseModel) -> Iterator[Scenario]:
    """Two adapters released through the flow onto both workers: echo-bot for everyone,
    private-bot for team-a only."""
    with pytest.MonkeyPatch.context() as env:
        for name, value in mixed_fleet.config.to_env().items():
            env.setenv(name, value)
        registry = Registry(mixed_fleet.config.tracking_uri)
        scenario = Scenario(mixed_fleet, {}, registry)
        release(OPEN, "reverse", steps=40, seed=1)
        release(PRIVATE, "upper", steps=40, seed=2, principals=["team-a"])
        for revision in (f"{OPEN}:r1", f"{PRIVATE}:r1"):
            scenario.expect(base, revision)
        yield scenario


@pytest.mark.parametrize("kind", KINDS)
def test_served_answers_equal_peft_generate(scenario: Scenario, kind: BackendKind) -> None:
    scenario.check_answers(kind, f"{OPEN}@production", f"{OPEN}:r1")
    scenario.check_answers(kind, f"{PRIVATE}:r1", f"{PRIVATE}:r1")
    # The two adapters, and the base, answer differently: none stands in for another.
    base_id = str(health(scenario.worker(kind))["base_model"])
    base_answers = [served(scenario.worker(kind), base_id, p, TEAM_A)[1] for p in PROMPTS[:2]]
    assert scenario.expected[f"{OPEN}:r1"] != scenario.expected[f"{PRIVATE}:r1"]
    assert base_answers != scenario.expected[f"{OPEN}:r1"][:2]


def test_both_workers_were_ready_before_activation_and_answer_alike(scenario: Scenario) -> None:
    for revision in (f"{OPEN}:r1", f"{PRIVATE}:r1"):
        adapter, number = revision.split(":r")
        activated = scenario.registry.revisions.get(RevisionId(adapter, int(number))).tags[
            ACTIVATED_AT_TAG
        ]
        activated_at = datetime.fromisoformat(activated).timestamp()
        for kind in KINDS:
            events = events_of(scenario.worker(kind))
            ready = [e["at"] for e in events if (e["id"], e["state"]) == (revision, "ready")]
            assert ready and ready[0] <= activated_at, (kind, revision)
    prompt = PROMPTS[0]
    assert len({tuple(served(scenario.worker(k), OPEN, prompt, TEAM_A)[1]) for k in KINDS}) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_burst_of_admissions_prewarms_one_at_a_time(
    scenario: Scenario, kind: BackendKind, base: BaseModel, tmp_path: Path
) -> None:
    """Three revisions admitted at once on a worker with admission K=1: its event log, replayed,
    never has two fetching or warming at the same time."""
    worker = scenario.worker(kind)
    burst = [
        register_random_adapter(
            scenario.fleet.config, base, f"burst-{kind}-{n}", tmp_path / str(n), n
        )
        for n in range(3)
    ]
    url = worker.url + "/admin/admit"
    assert wait_for(lambda: all(known(worker, r) for r in burst), timeout_s=30)
    for revision in burst:
        body = {"adapter": revision.adapter, "revision": revision.number}
        httpx.post(url, json=body, headers=ADMIN).raise_for_status()
    assert wait_for(lambda: all(readiness(worker, r)["state"] == "ready" for r in burst), 300)
    ids = {str(r) for r in burst}
    events = [e for e in events_of(worker) if e["id"] in ids]
    assert {e["state"] for e in events} >= {"queued", "fetching", "warming", "ready"}
    assert most_prewarming_at_once(events) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_revision_that_is_not_ready_answers_503_at_once(
    scenario: Scenario, kind: BackendKind, base: BaseModel, tmp_path: Path
) -> None:
    name = f"idle-{kind}"
    revision = register_random_adapter(scenario.fleet.config, base, name, tmp_path / "lora", 3)
    url = scenario.worker(kind).url + "/v1/completions"
    body = {"model": str(revision), "prompt": PROMPTS[0], "max_tokens": 4}
    # The worker learns of the revision at its next sync (every half second).
    assert wait_for(lambda: httpx.post(url, json=body, headers=TEAM_A).status_code != 404, 30)
    started = time.perf_counter()
    response = httpx.post(url, json=body, headers=TEAM_A)
    assert time.perf_counter() - started < 1.0
    assert response.status_code == 503, response.text
    assert response.headers["Retry-After"]
    assert response.json()["state"] == "not_admitted"


@pytest.mark.parametrize("kind", KINDS)
def test_a_principal_the_policy_excludes_gets_403(scenario: Scenario, kind: BackendKind) -> None:
    body = {"inputs": PROMPTS[0], "parameters": {"adapter_id": f"{PRIVATE}:r1"}}
    response = httpx.post(scenario.worker(kind).url + "/generate", json=body, headers=TEAM_B)
    assert response.status_code == 403, response.text
    assert "team-b" in response.json()["error"]


def test_r2_then_rollback_to_r1_on_both_backends(scenario: Scenario, base: BaseModel) -> None:
    with pytest.MonkeyPatch.context() as env:
        for name, value in scenario.fleet.config.to_env().items():
            env.setenv(name, value)
        release(OPEN, "reverse", steps=40, seed=3)
        scenario.expect(base, f"{OPEN}:r2")
        assert scenario.expected[f"{OPEN}:r2"] != scenario.expected[f"{OPEN}:r1"]
        for kind in KINDS:
            scenario.check_answers(kind, f"{OPEN}@production", f"{OPEN}:r2")
        assert rollback(OPEN, actor="oncall", reason="contract") == f"{OPEN}:r1"
    for kind in KINDS:
        scenario.check_answers(kind, f"{OPEN}@production", f"{OPEN}:r1")


def test_an_adapter_vllm_refuses_fails_with_its_reason_and_production_stays(
    scenario: Scenario,
) -> None:
    """Rank 16 is over the vLLM worker's --max-lora-rank 8; the embedded worker takes it."""
    before = scenario.registry.revisions.resolve(RevisionRef(OPEN)).id
    with pytest.MonkeyPatch.context() as env:
        for name, value in scenario.fleet.config.to_env().items():
            env.setenv(name, value)
        with pytest.raises(NotReadyError, match="max_lora_rank"):
            release(OPEN, "reverse", steps=5, rank=16, alpha=32)
    refused = max(scenario.registry.revisions.of(OPEN), key=lambda r: r.id.number).id
    assert refused.number > before.number
    entry = readiness(scenario.worker(BackendKind.VLLM), refused)
    assert entry["state"] == "failed"
    assert "LoRA rank 16 is greater than max_lora_rank 8" in entry["reason"]
    assert readiness(scenario.worker(BackendKind.EMBEDDED), refused)["state"] == "ready"
    assert scenario.registry.revisions.resolve(RevisionRef(OPEN)).id == before
    for kind in KINDS:
        scenario.check_answers(kind, f"{OPEN}@production", str(before))


@pytest.mark.parametrize("kind", KINDS)
def test_streams_in_either_protocol_carry_the_single_request_answer(
    scenario: Scenario, kind: BackendKind
) -> None:
    """TGI's and OpenAI's streams (on the vLLM worker, translated to and from vLLM's
    completions API): TGI's events carry the single-request answer's token ids and text,
    OpenAI's pieces add up to its text."""
    url, revision = scenario.worker(kind).url, f"{OPEN}:r1"
    for i, prompt in enumerate(PROMPTS[:3]):
        body = {"model": revision, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
        answer = httpx.post(url + "/v1/completions", json=body, headers=TEAM_A, timeout=60)
        text = answer.json()["choices"][0]["text"]

        parameters = {"adapter_id": revision, "max_new_tokens": NEW_TOKENS}
        tgi = {"inputs": prompt, "parameters": parameters}
        events = [json.loads(data) for data in sse_data(url + "/generate_stream", tgi)]
        assert [e["token"]["id"] for e in events] == scenario.expected[revision][i]
        assert events[-1]["generated_text"] == text

        chunks = [
            json.loads(data) for data in sse_data(url + "/v1/completions", body | {"stream": True})
        ]
        assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == text


def sse_data(url: str, body: dict[str, object]) -> list[str]:
    """The data of each server-sent event of a streamed answer, up to OpenAI's [DONE]."""
    with httpx.stream("POST", url, json=body, headers=TEAM_A, timeout=60) as stream:
        stream.raise_for_status()
        data = [line[5:].strip() for line in stream.iter_lines() if line.startswith("data:")]
    return [d for d in data if d != "[DONE]"]


def test_vllm_killed_under_load_comes_back_and_never_answers_wrongly(scenario: Scenario) -> None:
    worker = scenario.worker(BackendKind.VLLM)
    production = {
        f"{OPEN}@production": str(scenario.registry.revisions.resolve(RevisionRef(OPEN)).id),
        f"{PRIVATE}@production": f"{PRIVATE}:r1",
    }
    expected = {
        (model, prompt): scenario.expected[revision][i]
        for model, revision in production.items()
        for i, prompt in enumerate(PROMPTS)
    }
    wrong: list[object] = []
    statuses: list[tuple[float, str, int]] = []
    stop = threading.Event()

    def client(offset: int) -> None:
        with httpx.Client(timeout=CLIENT_TIMEOUT_S) as http:
            n = offset
            while not stop.is_set():
                model, prompt = list(expected)[n % len(expected)]
                n += 1
                body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS,
                        "temperature": 0, "return_token_ids": True}  # fmt: skip
                try:
                    response = http.post(worker.url + "/v1/completions", json=body, headers=TEAM_A)
                except httpx.TransportError as e:
                    wrong.append(("transport", model, repr(e)))
                    continue
                statuses.append((time.monotonic(), model, response.status_code))
                if response.status_code == 200:
                    tokens = response.json()["choices"][0]["token_ids"]
                    header = response.headers["X-Mint-Revision"]
                    if (header, tokens) != (production[model], expected[model, prompt]):
                        wrong.append((model, prompt, header, tokens))
                else:
                    time.sleep(0.05)

    clients = [threading.Thread(target=client, args=(n,)) for n in range(4)]
    for thread in clients:
        thread.start()
    try:
        # Under load: every model answered before the kill. A client reaches the second model
        # within one pass over the first's prompts, each answered within CLIENT_TIMEOUT_S.
        loaded = wait_for(
            lambda: {m for _, m, s in statuses if s == 200} == set(production),
            timeout_s=len(PROMPTS) * CLIENT_TIMEOUT_S,
        )
        assert loaded, f"not every model answered before the kill: {statuses[-8:]} {wrong}"
        vllm = vllm_pid(worker)
        sockets = vllm_sockets(vllm)
        killed = set(sockets.iterdir())
        assert killed, f"vLLM made no socket in {sockets}"
        killed_at = time.monotonic()
        os.kill(vllm, signal.SIGKILL)
        degraded = wait_for(lambda: health(worker)["status"] == "degraded", timeout_s=30)
        assert degraded, "the worker never reported degraded"
        recovered = wait_for(
            lambda: all(
                any(m == model and t > killed_at and s == 200 for t, m, s in statuses[-8:])
                for model in production
            ),
            timeout_s=600,
        )
        recovery_s = time.monotonic() - killed_at
    finally:
        stop.set()
        for thread in clients:
            thread.join()
    assert recovered, f"no answers for every production revision after the kill: {statuses[-8:]}"
    print(
        f"vLLM SIGKILLed under load: every production revision served again in {recovery_s:.1f} s"
    )
    assert wrong == []
    assert health(worker)["status"] == "ok"
    after = [s for t, _, s in statuses if t > killed_at]
    assert set(after) <= {200, 503}, sorted(set(after))
    assert vllm_pid(worker) != vllm
    # The killed vLLM's sockets were removed before the next one made its own there.
    assert vllm_sockets(vllm_pid(worker)) == sockets
    assert not killed & set(sockets.iterdir())


def test_an_engine_core_death_is_answered_503_then_the_worker_restarts_vllm_and_serves_again(
    scenario: Scenario,
) -> None:
    """vLLM's EngineCore (the child of its API server that runs the model) is SIGKILLed, the
    API server left alive: the worker notices (degraded), answers 503 with a reason while
    nothing can serve (never a wrong answer nor a 500), starts vLLM again, prewarms its
    revisions again and serves the adapter as before."""
    worker = scenario.worker(BackendKind.VLLM)
    model, revision = f"{PRIVATE}@production", f"{PRIVATE}:r1"
    scenario.check_answers(BackendKind.VLLM, model, revision)
    server = vllm_pid(worker)
    killed_at = time.time()
    os.kill(engine_core_pid(server), signal.SIGKILL)

    refusals: list[str] = []

    def serves_again() -> float | None:
        """None once both prompts are answered, each right; else the pause its refusal asks."""
        for i, prompt in enumerate(PROMPTS[:2]):
            body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS,
                    "temperature": 0, "return_token_ids": True}  # fmt: skip
            response = httpx.post(
                worker.url + "/v1/completions", json=body, headers=TEAM_A, timeout=60
            )
            if response.status_code != 200:
                assert response.status_code == 503, response.text
                refusals.append(response.json()["error_type"])
                return pause_s(response, LONGEST_PAUSE_S)
            answer = response.headers["X-Mint-Revision"], response.json()["choices"][0]
            assert (answer[0], answer[1]["token_ids"]) == (revision, scenario.expected[revision][i])
        return None

    assert wait_for(lambda: health(worker)["status"] == "degraded", timeout_s=120), (
        "the worker never noticed that vLLM's engine died"
    )
    assert retried(serves_again, SERVE_AGAIN_TRIES), f"not served again; refused as {refusals}"
    assert {"not_ready", "engine_unavailable"} & set(refusals), refusals
    assert set(refusals) <= {"not_ready", "engine_unavailable", "service"}, refusals
    assert health(worker)["status"] == "ok"
    # Prewarmed again after the engine came back, through both phases.
    after = [e for e in events_of(worker) if e["id"] == revision and e["at"] > killed_at]
    states = [e["state"] for e in after]
    assert states[0] == "not_admitted" and states[-1] == "ready", states
    assert "warming" in states, states


def engine_core_pid(server: int) -> int:
    """vLLM's EngineCore process: the child of its API server `server` that runs the model."""
    found = child_pid(server, b"EngineCore")
    if found is None:
        raise NotFoundError(f"vLLM's API server {server} has no EngineCore child")
    return found


def child_pid(parent: int, marker: bytes) -> int | None:
    """A child of `parent` whose command line contains `marker`; None if there is none."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rpartition(")")[2].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and marker in cmdline:
            return int(stat.parent.name)
    return None


def known(worker: ManagedProcess, revision: RevisionId) -> bool:
    """Whether the worker's catalog has synced `revision` yet."""
    response = httpx.get(worker.url + f"/v1/adapters/{revision.adapter}", headers=ADMIN)
    return response.status_code == 200


def events_of(worker: ManagedProcess) -> list[dict[str, object]]:
    return httpx.get(worker.url + "/admin/events", headers=ADMIN).json()["events"]


def readiness(worker: ManagedProcess, revision: RevisionId) -> dict[str, object]:
    response = httpx.get(worker.url + f"/v1/adapters/{revision.adapter}", headers=ADMIN)
    response.raise_for_status()
    (entry,) = [e for e in response.json()["revisions"] if e["revision"] == revision.number]
    return entry


def health(worker: ManagedProcess) -> dict[str, object]:
    return httpx.get(worker.url + "/health", timeout=10).json()


def vllm_pid(worker: ManagedProcess) -> int:
    """The vLLM server the worker started: its child running vLLM's OpenAI entry point."""
    found = child_pid(worker.process.pid, VLLM_SERVER.encode())
    if found is None:
        raise NotFoundError(f"worker {worker.url} runs no vLLM server")
    return found


def retried(ask: Callable[[], float | None], tries: int) -> bool:
    """Whether `ask()` succeeded (None) within `tries` calls, each failed one followed by the
    pause it returns (a second when the worker does not answer yet)."""
    for _ in range(tries):
        try:
            pause = ask()
        except httpx.TransportError:
            pause = 1.0
        if pause is None:
            return True
        time.sleep(pause)
    return False


def wait_for(probe: Callable[[], bool], timeout_s: float) -> bool:
    """Whether `probe()` became true within `timeout_s` (a worker that does not answer yet
    counts as false)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if probe():
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    return False
