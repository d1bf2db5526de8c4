"""The backend contract's tests (`test_backends`, `test_fuzz`'s vLLM lane) share one mixed fleet,
started for this folder's tests and stopped after its last: held to the end of the session, its
vLLM engine and two syncing workers cost some 7 s of CPU a minute idle on 2 cores (vLLM 2.4,
its MLflow 3.9, the embedded worker 0.9), in a lane that is short of CPU. `make test` runs the
folder in one process (tests/conftest.py's groups)."""

import dataclasses
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from control.services import start_mlflow
from mint_core.config import BackendKind, MintConfig
from processes import ManagedProcess, stop_all
from serving.worker.server import start_worker
from tests.integration.helpers import VLLM_SERVER, MixedFleet, vllm_sockets

VLLM_START_TIMEOUT_S = 900
"""A vLLM worker is up once vLLM is: a minute or two of imports on a busy 2-core machine."""


@pytest.fixture(scope="package")
def mixed_fleet(
    config: MintConfig, prefect_api: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[MixedFleet]:
    """One embedded and one vLLM worker over a registry of their own (admission K=1, API keys,
    vLLM's `--max-lora-rank` 8, 4 device slots): the fleet the backend contract runs on."""
    home = tmp_path_factory.mktemp("mixed-fleet")
    mlflow = start_mlflow(home / "registry")
    fleet_config = dataclasses.replace(
        config, tracking_uri=mlflow.url, admission_k=1, sync_interval_s=0.5, max_lora_rank=8
    )
    kinds = (BackendKind.EMBEDDED, BackendKind.VLLM)
    configs = {
        kind: dataclasses.replace(fleet_config, backend=kind, device_slots=4, max_batch=16)
        for kind in kinds
    }
    workers: dict[BackendKind, ManagedProcess] = {}
    try:
        with ThreadPoolExecutor(len(kinds)) as pool:
            started = {
                kind: pool.submit(start_worker, configs[kind], timeout_s=VLLM_START_TIMEOUT_S)
                for kind in kinds
            }
            for kind, future in started.items():
                workers[kind] = future.result()
        urls = tuple(workers[kind].url for kind in kinds)
        # Every revision on both backends: a roll-out waits for both.
        both = dataclasses.replace(fleet_config, worker_urls=urls, replicas=2)
        yield MixedFleet(both, workers, mlflow)
    finally:
        vllm = workers.get(BackendKind.VLLM)
        servers = psutil.Process(vllm.process.pid).children() if vllm else []
        sockets = next((vllm_sockets(s.pid) for s in servers if VLLM_SERVER in s.cmdline()), None)
        stop_all([*workers.values(), mlflow])
        # A worker stopping removes its vLLM's sockets (vLLM left them in /tmp for good).
        assert sockets is None or not sockets.exists(), f"{sockets} left behind"
