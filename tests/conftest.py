"""Session fixtures: a tiny base, a real `mlflow server`, a real worker process and Prefect's
local API, all on loopback, started once per session and always stopped."""

import copy
import dataclasses
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

# Prefect reads its settings when first imported, and a bare import writes to PREFECT_HOME:
# point it at a temporary folder before any test module imports it.
_SESSION_DIR = Path(tempfile.mkdtemp(prefix="mint-tests-"))
os.environ["PREFECT_HOME"] = str(_SESSION_DIR / "prefect")
os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "120"
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["DO_NOT_TRACK"] = "1"
os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
os.environ.pop("PREFECT_API_URL", None)
# boto3 needs credentials; these are moto's dummies. Every S3 client in the tests names the
# loopback moto server as its endpoint, and the metadata service is never asked.
os.environ.update(
    AWS_ACCESS_KEY_ID="mint-tests",
    AWS_SECRET_ACCESS_KEY="mint-tests",
    AWS_DEFAULT_REGION="us-east-1",
    AWS_EC2_METADATA_DISABLED="true",
)

from mint_cli import quiet_libraries  # noqa: E402
from mint_core.artifact_store import (  # noqa: E402
    ArtifactStore,
    LocalArtifactStore,
    S3ArtifactStore,
    open_store,
)
from mint_core.base_model import BaseModel, load_base  # noqa: E402
from mint_core.config import MintConfig  # noqa: E402
from mint_core.packing import PackedIndex  # noqa: E402
from mint_core.revisions import RevisionId  # noqa: E402
from mint_core.services import ManagedProcess, start_mlflow, start_s3  # noqa: E402
from mint_core.textgen import seeded  # noqa: E402
from mint_core.training import TrainingConfig  # noqa: E402
from serving.client import WorkerClient  # noqa: E402
from serving.server import start_worker  # noqa: E402
from tasks.pipeline import (  # noqa: E402
    Exported,
    check_import,
    export_adapter,
    freeze_adapter,
    pack_adapter,
    register_revision,
    train_adapter,
)

quiet_libraries()

API_KEYS = {"key-team-a": "team-a", "key-team-b": "team-b"}
"""The session worker's API keys (tests only; a deployment reads them from its environment)."""


def register_step_by_step(
    config: MintConfig, adapter: str, task: str
) -> tuple[RevisionId, Exported, PackedIndex]:
    """Train (briefly) through register by calling the pipeline's tasks one at a time."""
    trained = train_adapter.fn(config, adapter, task, TrainingConfig(steps=5), config.base)
    frozen = freeze_adapter.fn(config, trained.path)
    packed_dir, index = pack_adapter.fn(config, frozen)
    exported = export_adapter.fn(config, packed_dir, index)
    return register_revision.fn(config, adapter, trained, frozen, exported, "test"), exported, index


def register_random_adapter(
    config: MintConfig, base: BaseModel, name: str, folder: Path, seed: int
) -> RevisionId:
    """A random LoRA (a stand-in for one trained elsewhere) taken through the pipeline's steps
    from import check to register: the next revision of `name`, not admitted anywhere."""
    rank = 1 + seed % 8
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj", "up_proj"])
    random_lora(base.model, lora, seed, std=0.3).save_pretrained(folder)
    imported = check_import.fn(config, folder)
    frozen = freeze_adapter.fn(config, imported.path)
    packed_dir, index = pack_adapter.fn(config, frozen)
    exported = export_adapter.fn(config, packed_dir, index)
    return register_revision.fn(config, name, imported, frozen, exported, "tests")


def random_lora(model: torch.nn.Module, lora: LoraConfig, seed: int, std: float) -> PeftModel:
    """A PEFT LoRA over a copy of `model` with random non-zero weights: a stand-in for one that
    learned something (PEFT initialises B to zero, which would change nothing)."""
    with seeded(seed):
        peft = get_peft_model(copy.deepcopy(model), lora)
        with torch.no_grad():
            for name, parameter in peft.named_parameters():
                if "lora_" in name:
                    parameter.normal_(0.0, std)
    return peft.eval()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_SESSION_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def mint_home() -> Path:
    home = _SESSION_DIR / "mint"
    home.mkdir(exist_ok=True)
    return home


@pytest.fixture(scope="session")
def base(mint_home: Path) -> BaseModel:
    """The serving base, pretrained once per session (about 40 s on 2 cores)."""
    return load_base(MintConfig().base, mint_home)


@pytest.fixture(scope="session")
def mlflow_server(mint_home: Path) -> Iterator[ManagedProcess]:
    server = start_mlflow(mint_home / "registry")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def config(mint_home: Path, mlflow_server: ManagedProcess, base: BaseModel) -> MintConfig:
    return MintConfig(
        home=mint_home,
        tracking_uri=mlflow_server.url,
        api_keys=API_KEYS,
        worker_api_key="key-team-a",
    )


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[str]:
    """A Prefect server (a subprocess) for the session's flows; yields its API URL for child
    processes. Stopped at session end (Prefect's own exit hook would log to pytest's
    already-closed output)."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield str(PREFECT_API_URL.value())


@pytest.fixture(scope="session")
def worker(config: MintConfig, prefect_api: str) -> Iterator[ManagedProcess]:
    """A serving worker process; the flows in this session activate against it."""
    process = start_worker(config)
    # Flows read their configuration from the environment, as at any entry point.
    os.environ["MINT_HOME"] = str(config.home)
    os.environ["MLFLOW_TRACKING_URI"] = config.tracking_uri
    os.environ["MINT_WORKER_URLS"] = process.url
    os.environ["MINT_WORKER_API_KEY"] = config.worker_api_key
    yield process
    process.stop()


@pytest.fixture(scope="session")
def fleet_config(config: MintConfig, worker: ManagedProcess) -> MintConfig:
    return MintConfig(
        home=config.home,
        tracking_uri=config.tracking_uri,
        worker_urls=(worker.url,),
        worker_api_key=config.worker_api_key,
    )


@pytest.fixture(scope="session")
def client(worker: ManagedProcess) -> Iterator[WorkerClient]:
    worker_client = WorkerClient(worker.url)
    yield worker_client
    worker_client.close()


@pytest.fixture(scope="session")
def s3_server(mint_home: Path) -> Iterator[ManagedProcess]:
    """moto's S3 server on loopback: a real S3 API over HTTP, not an in-process mock."""
    server = start_s3(mint_home)
    yield server
    server.stop()


def create_bucket(endpoint_url: str, name: str) -> None:
    boto3.client("s3", endpoint_url=endpoint_url).create_bucket(Bucket=name)


@dataclass(frozen=True)
class Fleet:
    """A worker and the configuration flows use with it, over one kind of artifact store.
    Tests damage the store through it the way a disk or a careless operator would."""

    store_kind: str
    config: MintConfig
    worker: ManagedProcess

    @property
    def store(self) -> ArtifactStore:
        return open_store(self.config)

    def adapter(self, name: str) -> str:
        """A name unique to this fleet (both fleets share one MLflow server)."""
        return name if self.store_kind == "local" else f"{name}-{self.store_kind}"

    def lose(self, uri: str) -> None:
        """Delete an artifact from the store."""
        store = self.store
        if isinstance(store, LocalArtifactStore):
            shutil.rmtree(store.fetch(uri))
            return
        assert isinstance(store, S3ArtifactStore)
        s3 = boto3.client("s3", endpoint_url=self.config.s3_endpoint_url)
        digest = store.digest_of(uri)
        for shard in self._index(store, uri).shards:
            s3.delete_object(Bucket=store.bucket, Key=store.shard_key(shard.sha256))
        s3.delete_object(Bucket=store.bucket, Key=store.index_key(digest))

    def corrupt(self, uri: str, shard_name: str) -> None:
        """Flip the last byte of one shard of an artifact, in the store itself."""
        store = self.store
        if isinstance(store, LocalArtifactStore):
            path = store.fetch(uri) / shard_name
            data = bytearray(path.read_bytes())
            data[-1] ^= 0xFF
            path.write_bytes(bytes(data))
            return
        assert isinstance(store, S3ArtifactStore)
        s3 = boto3.client("s3", endpoint_url=self.config.s3_endpoint_url)
        shard = next(s for s in self._index(store, uri).shards if s.name == shard_name)
        key = store.shard_key(shard.sha256)
        data = bytearray(s3.get_object(Bucket=store.bucket, Key=key)["Body"].read())
        data[-1] ^= 0xFF
        s3.put_object(Bucket=store.bucket, Key=key, Body=bytes(data))

    @staticmethod
    def _index(store: S3ArtifactStore, uri: str) -> PackedIndex:
        index = store.stored_index(store.digest_of(uri))
        assert index is not None, uri
        return index


@pytest.fixture(scope="session")
def s3_worker(
    config: MintConfig, s3_server: ManagedProcess, worker: ManagedProcess
) -> Iterator[ManagedProcess]:
    """A second worker whose artifacts live in S3 (moto); same MLflow server and base."""
    create_bucket(s3_server.url, "mint-fleet")
    s3_config = dataclasses.replace(
        config, artifact_store="s3", s3_bucket="mint-fleet", s3_endpoint_url=s3_server.url
    )
    process = start_worker(s3_config)
    yield process
    process.stop()


@pytest.fixture(params=["local", "s3"])
def fleet(
    request: pytest.FixtureRequest, fleet_config: MintConfig, monkeypatch: pytest.MonkeyPatch
) -> Fleet:
    """The same scenario over each artifact store. Flows read their configuration from the
    environment, as at any entry point, so the fleet's is put there for the test."""
    if request.param == "local":
        fleet = Fleet("local", fleet_config, request.getfixturevalue("worker"))
    else:
        s3_worker: ManagedProcess = request.getfixturevalue("s3_worker")
        s3_server: ManagedProcess = request.getfixturevalue("s3_server")
        s3_config = dataclasses.replace(
            fleet_config,
            worker_urls=(s3_worker.url,),
            artifact_store="s3",
            s3_bucket="mint-fleet",
            s3_endpoint_url=s3_server.url,
        )
        fleet = Fleet("s3", s3_config, s3_worker)
    for name, value in fleet.config.to_env().items():
        monkeypatch.setenv(name, value)
    return fleet
