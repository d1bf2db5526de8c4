"""Work pools (`flows.pools`): every served flow goes to exactly one pool, the flows that train
to the train pool; what `deploy_to_pools` asks of Prefect (the pools, each deployment's pool,
tag and run environment, the crash automation); the crash watch's bounds. The Prefect server's
side runs in tests/integration/test_work_pools.py."""

from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from unittest import mock
from uuid import UUID, uuid4

import pytest
from prefect.client.schemas.objects import StateType
from prefect.deployments.runner import RunnerDeployment
from prefect.events.schemas.automations import AutomationCore, Posture
from prefect.exceptions import ObjectNotFound

import flows.pools
from flows.deployments import POOLS, Pool, build_deployments, deployments_by_pool
from flows.pools import (
    AUTOMATION,
    CrashWatch,
    crash_automation,
    deploy_to_pools,
)
from mint_core.config import MintConfig
from mint_core.errors import ConfigurationError
from mint_core.retraining import RetrainSchedule

# Prefect's cron schedules import croniter, which asks `file` about the interpreter on import
# (platform.architecture): a process, which this lane refuses. Its answer here is no news.
with mock.patch("platform.architecture", return_value=("64bit", "ELF")):
    import prefect._vendor.croniter

CONFIG = MintConfig(
    retrain=(RetrainSchedule("nightly-bot", "/data/nightly.jsonl", "0 3 * * *"),),
    train_pool="gpu-pool",
    control_pool="cpu-pool",
)

TRAINING = {"release", "import", "retrain", "retrain-nightly-bot", "rl", "train-node"}
"""The deployments whose runs train: the ones that need a train host."""


def test_every_served_flow_is_in_exactly_one_pool() -> None:
    pooled = deployments_by_pool(CONFIG)
    placed = [d.name for deployments in pooled.values() for d in deployments]
    assert sorted(placed) == sorted(d.name for d in build_deployments(CONFIG))
    assert len(placed) == len(set(placed))
    assert POOLS.keys() == {d.flow_name for d in build_deployments(CONFIG)}
    assert {d.name for d in pooled[Pool.TRAIN]} == TRAINING
    assert {d.name for d in pooled[Pool.CONTROL]} == {
        "promote", "rollback", "canary", "repair", "approve", "catalog-snapshot", "usage-report"
    }  # fmt: skip


def test_import_is_served() -> None:
    (deployment,) = [d for d in build_deployments(CONFIG) if d.name == "import"]
    assert deployment.flow_name == "import"
    assert deployment.entrypoint == "flows.release.import_adapter"
    assert deployment._parameter_openapi_schema.required == ["adapter", "path", "actor"]


def test_pools_are_named_by_the_configuration() -> None:
    assert [pool.work_pool(CONFIG) for pool in Pool] == ["gpu-pool", "cpu-pool"]
    assert [pool.work_pool(MintConfig()) for pool in Pool] == ["mint-train", "mint-control"]


@pytest.mark.parametrize(
    ("heartbeat_s", "crash_after_s", "refusal"),
    [
        (10, 90, "no less than 30 s"),
        (30, 30, "would crash healthy runs"),
        (60, 45, "would crash healthy runs"),
    ],
)
def test_a_crash_watch_that_would_crash_healthy_runs_is_refused(
    heartbeat_s: int, crash_after_s: int, refusal: str
) -> None:
    with pytest.raises(ConfigurationError, match=refusal):
        CrashWatch(heartbeat_s, crash_after_s)


def test_the_crash_automation_watches_the_pools_runs_for_missing_heartbeats() -> None:
    automation = crash_automation(CONFIG, CrashWatch(30, 75))
    trigger = automation.trigger
    assert trigger.posture == Posture.Proactive
    assert trigger.within == timedelta(seconds=75)
    assert trigger.after == {"prefect.flow-run.heartbeat"}
    assert trigger.expect == {
        "prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Failed",
        "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed",
    }  # fmt: skip
    assert trigger.for_each == {"prefect.resource.id"}
    related = trigger.match_related
    assert related["prefect.resource.id"] == [
        "prefect.tag.pool:gpu-pool", "prefect.tag.pool:cpu-pool"
    ]  # fmt: skip
    (action,) = automation.actions
    assert action.state == StateType.CRASHED and "no heartbeat for 75 s" in action.message


class _Read:
    def __init__(self, id: UUID, name: str = "") -> None:
        self.id = id
        self.name = name


class _Prefect:
    """What `deploy_to_pools` asks of Prefect's client, recorded (the API is real in the
    integration test)."""

    def __init__(self, pools: set[str]) -> None:
        self.pools = set(pools)
        self.created_pools: list[tuple[str, str]] = []
        self.automations: dict[UUID, AutomationCore] = {uuid4(): _named(AUTOMATION)}
        self.applied: list[tuple[str, str, list[str], dict[str, Any]]] = []
        self.stale = _Read(uuid4(), "retrain-dropped-bot")
        self.deployments = {self.stale.id: self.stale}
        self.asked_tags: list[str] = []

    def __enter__(self) -> "_Prefect":
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def read_work_pool(self, name: str) -> None:
        if name not in self.pools:
            raise ObjectNotFound(http_exc=Exception(name))

    def create_work_pool(self, work_pool: Any) -> None:
        self.pools.add(work_pool.name)
        self.created_pools.append((work_pool.name, work_pool.type))

    def read_deployments(self, deployment_filter: Any) -> list[_Read]:
        self.asked_tags = deployment_filter.tags.any_
        return list(self.deployments.values())

    def delete_deployment(self, deployment_id: UUID) -> None:
        del self.deployments[deployment_id]

    def read_automations_by_name(self, name: str) -> list[Any]:
        return [_Read(id) for id, a in self.automations.items() if a.name == name]

    def delete_automation(self, automation_id: UUID) -> None:
        del self.automations[automation_id]

    def create_automation(self, automation: AutomationCore) -> UUID:
        self.automations[automation_id := uuid4()] = automation
        return automation_id


def _named(name: str) -> AutomationCore:
    return crash_automation(MintConfig(), CrashWatch()).model_copy(update={"name": name})


@pytest.fixture
def prefect(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Prefect]:
    recorded = _Prefect({"cpu-pool"})

    def apply(self: RunnerDeployment, work_pool_name: str | None = None, **_: object) -> UUID:
        recorded.applied.append((self.name, str(work_pool_name), self.tags, self.job_variables))
        deployment_id = uuid4()
        recorded.deployments[deployment_id] = _Read(deployment_id, self.name)
        return deployment_id

    monkeypatch.setattr(flows.pools, "get_client", lambda sync_client: recorded)
    monkeypatch.setattr(RunnerDeployment, "apply", apply)
    yield recorded


def test_deploy_creates_the_missing_pool_and_puts_each_deployment_in_its_pool(
    prefect: _Prefect,
) -> None:
    deployed = deploy_to_pools(CONFIG, CrashWatch(30, 60))

    assert prefect.created_pools == [("gpu-pool", "process")]
    pools = {name: pool for name, pool, _, _ in prefect.applied}
    assert {name for name, pool in pools.items() if pool == "gpu-pool"} == TRAINING
    assert len(pools) == len(prefect.applied) == len(deployed.deployment_ids) == 13
    for name, pool, tags, job_variables in prefect.applied:
        assert tags == ["mint", f"pool:{pool}"], name
        assert job_variables == {"env": {
            "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30",
            "PREFECT_RUNNER_AUTO_INSTALL_DEPENDENCIES": "false",
        }}  # fmt: skip
    assert set(deployed.deployments["gpu-pool"]) == {
        "release/release", "import/import", "retrain/retrain", "retrain/retrain-nightly-bot",
        "rl/rl", "train-node/train-node",
    }  # fmt: skip
    # What an earlier deploy made and this one has not is gone: its schedule would go on.
    assert prefect.asked_tags == ["pool:gpu-pool", "pool:cpu-pool"]
    assert deployed.removed == ("retrain-dropped-bot",)
    assert prefect.stale.id not in prefect.deployments
    assert len(prefect.deployments) == 13
    # The earlier deploy's automation is replaced, not kept beside the new one.
    (automation,) = prefect.automations.values()
    assert deployed.automation_id in prefect.automations
    assert automation.trigger.within == timedelta(seconds=60)
