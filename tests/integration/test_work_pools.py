"""Work pools on the session's Prefect server (`flows.pools`): `deploy_to_pools` makes the two
process pools, puts each deployment in its pool and installs the crash automation; a real
`prefect worker start` (a host's, polling its pool's default queue and its own) runs a catalog
snapshot sent to its host's queue, which completes there and carries the host's tag."""

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from prefect import get_client
from prefect.deployments import run_deployment

from control.services import host_queue, start_prefect_worker
from flows.pools import AUTOMATION, CrashWatch, Deployed, deploy_to_pools
from mint_core.config import MintConfig
from processes import ManagedProcess

pytestmark = pytest.mark.slow

WATCH = CrashWatch(heartbeat_s=30, crash_after_s=60)


@pytest.fixture
def pools(
    mint_home: Path, mlflow_server: ManagedProcess, prefect_api: str
) -> Iterator[tuple[MintConfig, Deployed]]:
    """The deployments in pools of their own, named for this test, all removed afterwards:
    the session's other tests serve deployments of the same names. The catalog snapshot needs
    the registry, not the session's base or workers."""
    config = MintConfig(
        home=mint_home,
        tracking_uri=mlflow_server.url,
        host="pools-host",
        train_pool="test-train",
        control_pool="test-control",
    )
    deployed = deploy_to_pools(config, WATCH)
    yield config, deployed
    with get_client(sync_client=True) as client:
        for deployment_id in deployed.deployment_ids:
            client.delete_deployment(deployment_id)
        client.delete_automation(deployed.automation_id)
        for pool in deployed.deployments:
            client.delete_work_pool(pool)


def test_a_control_flow_runs_on_its_pools_worker_and_says_where(
    pools: tuple[MintConfig, Deployed], prefect_api: str
) -> None:
    config, deployed = pools
    assert "catalog-snapshot/catalog-snapshot" in deployed.deployments["test-control"]
    assert {
        "release/release",
        "import/import",
        "retrain/retrain",
        "rl/rl",
        "train-node/train-node",
    } == set(deployed.deployments["test-train"])
    with get_client(sync_client=True) as client:
        (automation,) = client.read_automations_by_name(AUTOMATION)
        release = client.read_deployment_by_name("release/release")
    assert automation.id == deployed.automation_id
    assert automation.trigger.within == timedelta(seconds=60)
    assert release.work_pool_name == "test-train" and "pool:test-train" in release.tags
    assert release.job_variables["env"]["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "30"

    worker = start_prefect_worker(
        config,
        config.control_pool,
        prefect_api,
        env={"PREFECT_WORKER_QUERY_SECONDS": "1"},
        queues=("default", host_queue(config)),
    )
    try:
        # Sent to the host's own queue: only a worker that polls it can run it.
        run = run_deployment(
            "catalog-snapshot/catalog-snapshot", work_queue_name="host-pools-host", timeout=180
        )
    finally:
        worker.stop()

    assert run.state is not None and run.state.is_completed(), (run.state, worker.log_tail())
    assert run.work_queue_name == "host-pools-host"
    with get_client(sync_client=True) as client:
        ran = client.read_flow_run(run.id)
    assert {"host:pools-host", "pool:test-control"} <= set(ran.tags)
    assert ran.infrastructure_pid is not None  # a subprocess of the worker, not of this test
