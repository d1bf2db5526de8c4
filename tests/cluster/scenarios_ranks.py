"""Training on both train hosts of the booted cluster (`release --nnodes 2`), as drivers
returning frozen figures (tests/cluster/scenarios.py has the one-host scenarios).

    release_on_two_hosts   a release with nnodes=2 through ctl's Prefect API: node 0 is its own
                           train host, a `train-node` run the other; the revision it registers,
                           its policy record and MLflow run say world size 2, both hosts, gloo;
                           the client host gets answers by it through the gateway
    rank_killed            a long release with nnodes=2 whose rank on the other host (node 1)
                           is SIGKILLed once rank 0 has stepped: the whole launch fails in
                           bounded time, nothing is registered, the node run ends, no rank is
                           left on either host and the roll-out slot is free
"""

import json
import os
import re
import signal
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.filters import (
    DeploymentFilter,
    DeploymentFilterId,
    FlowRunFilter,
    FlowRunFilterExpectedStartTime,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.client.schemas.objects import FlowRun

from mint_core.errors import ServiceError
from tests.cluster import drive, roles, scenarios
from tests.cluster.roles import Booted

TWO_HOSTS = {"nnodes": 2, "nproc_per_node": 1}
NODE_DEPLOYMENT = "train-node/train-node"
RANK_MODULE = "mint_core.distributed"
"""Each rank runs `python -m mint_core.distributed RUN_DIR` (torchrun names it after -m too)."""
GONE_TIMEOUT_S = 30.0
"""How long after the launch failed its processes may take to be gone (torchrun's SIGTERM
to its ranks, then SIGKILL after its grace)."""


@dataclass(frozen=True)
class TwoHostFigures:
    release: scenarios.ReleaseFigures
    node_run_host: str
    """The host of the `train-node` run the release started (the other train host)."""
    trained_with: dict[str, object]
    """The registered revision's policy record's `trained_with`."""
    mlflow_params: dict[str, str]
    mlflow_tags: dict[str, str]

    def as_json(self) -> dict[str, object]:
        return {"release_on_two_hosts": asdict(self)}


@dataclass(frozen=True)
class RankKilledFigures:
    release_host: str
    killed_host: str
    killed_pid: int
    final_state: str
    failed_s: float
    """From the SIGKILL until the test saw the release run in a final state (polled every
    0.5 s)."""
    node_run_state: str
    registered: int
    ranks_left: dict[str, list[int]]
    """host -> pids of rank or torchrun processes still there once the run ended."""
    slot_free: bool
    message: str = ""
    notes: dict[str, str] = field(default_factory=dict)

    def as_json(self) -> dict[str, object]:
        return {"rank_killed": asdict(self)}


def release_on_two_hosts(
    booted: Booted, folder: Path, adapter: str = "th-bot", steps: int = 8
) -> TwoHostFigures:
    """`scenarios.release_across_hosts` with nnodes=2, and what it recorded of its world."""
    started = datetime.now().astimezone()
    release = scenarios.release_across_hosts(booted, folder, adapter, steps, launch=TWO_HOSTS)
    with drive.prefect(booted) as prefect:
        (node,) = node_runs(prefect, started)
        node_run_host = node_host(prefect, node)
    mlflow = drive.Mlflow.of(booted)
    number = release.revision.rsplit(":r", 1)[1]
    (version,) = [v for v in mlflow.versions(adapter) if v["version"] == number]
    tags = {t["key"]: t["value"] for t in version.get("tags", [])}
    run = mlflow.get("runs/get", run_id=version["run_id"])["run"]["data"]
    return TwoHostFigures(
        release=release,
        node_run_host=node_run_host,
        trained_with=json.loads(tags.get("mint.trained_with", "{}")),
        mlflow_params={p["key"]: p["value"] for p in run.get("params", [])},
        mlflow_tags={t["key"]: t["value"] for t in run.get("tags", [])},
    )


def rank_killed(booted: Booted, adapter: str = "th-bot", steps: int = 5000) -> RankKilledFigures:
    """Start a long release on two hosts, SIGKILL node 1's rank once rank 0 has stepped, and
    return once the release run and its node run have ended."""
    data = drive.seed_data(booted, f"cluster/{adapter}/train.jsonl", 96)
    mlflow = drive.Mlflow.of(booted)
    started = datetime.now().astimezone()
    with drive.prefect(booted) as prefect:
        params = scenarios.release_parameters(adapter, data, steps) | TWO_HOSTS
        run = drive.start_release(prefect, params)
        run = drive.wait_run(
            prefect, run.id, lambda r: _training(prefect, r), scenarios.RUN_TIMEOUT_S, "training"
        )
        host = drive.run_host(run)
        (other,) = [h for h in roles.TRAIN if h != host]
        pid = _wait_stepping(booted, host, other, scenarios.RUN_TIMEOUT_S)
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        run = drive.wait_run(prefect, run.id, drive.is_final, scenarios.RUN_TIMEOUT_S, "final")
        failed_s = time.time() - killed_at
        (node,) = node_runs(prefect, started)
        node = drive.wait_run(prefect, node.id, drive.is_final, GONE_TIMEOUT_S, "final")
        left = _wait_ranks_gone(booted, GONE_TIMEOUT_S)
        slot_free = scenarios._slot_free(prefect, adapter)
        node_run_host = node_host(prefect, node)
    assert run.state is not None and node.state is not None
    return RankKilledFigures(
        release_host=host,
        killed_host=other,
        killed_pid=pid,
        final_state=str(run.state.type.value),
        failed_s=round(failed_s, 1),
        node_run_state=str(node.state.type.value),
        registered=len(mlflow.versions(adapter)),
        ranks_left=left,
        slot_free=slot_free,
        message=(run.state.message or "")[:600],
        notes={"node_run_host": node_run_host},
    )


def node_runs(prefect: SyncPrefectClient, since: datetime) -> list[FlowRun]:
    """The `train-node` runs started since `since` (the scenarios run one at a time)."""
    deployment = prefect.read_deployment_by_name(NODE_DEPLOYMENT)
    return prefect.read_flow_runs(
        deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])),
        flow_run_filter=FlowRunFilter(
            expected_start_time=FlowRunFilterExpectedStartTime(after_=since)
        ),
    )


def node_host(prefect: SyncPrefectClient, node: FlowRun) -> str:
    """Where a node run ran, as its log says (`node 1 of 2 on <host>: ...`)."""
    logs = prefect.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[node.id])))
    for log in logs:
        if found := re.search(r"node \d+ of \d+ on (\S+):", log.message):
            return found.group(1)
    return ""


def rank_pids(booted: Booted, role: str) -> dict[int, bool]:
    """pid -> whether it is a rank (else its torchrun) of every training process in `role`."""
    found: dict[int, bool] = {}
    for pid in booted.cluster.pids(role):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if RANK_MODULE in argv:
            found[pid] = "torch.distributed.run" not in argv
    return found


def _training(prefect: SyncPrefectClient, run: FlowRun) -> bool:
    if drive.is_final(run):
        raise ServiceError(f"flow run {run.name} ended before training: {run.state}")
    return bool(drive.run_host(run)) and drive.running_task(prefect, run.id, "train") is not None


def _wait_stepping(booted: Booted, host: str, other: str, timeout_s: float) -> int:
    """Node 1's rank on `other`, once rank 0 (on `host`) has written a step event."""
    deadline = time.monotonic() + timeout_s
    work = roles.home_of(booted.cluster, host) / "work" / "ranks"  # MintConfig.work_root
    while time.monotonic() < deadline:
        stepped = any(
            '"step"' in path.read_text(errors="replace") for path in work.glob("*/events.jsonl")
        )
        ranks = [pid for pid, is_rank in rank_pids(booted, other).items() if is_rank]
        if stepped and ranks:
            return ranks[0]
        time.sleep(0.5)
    raise ServiceError(f"no step by rank 0 on {host} with a rank on {other} in {timeout_s:.0f} s")


def _wait_ranks_gone(booted: Booted, timeout_s: float) -> dict[str, list[int]]:
    deadline = time.monotonic() + timeout_s
    while True:
        left = {h: sorted(rank_pids(booted, h)) for h in roles.TRAIN}
        if not any(left.values()) or time.monotonic() > deadline:
            return {h: pids for h, pids in left.items() if pids}
        time.sleep(0.5)
