"""Driving the booted cluster from the test process, as an operator's tools would, with explicit
clients: the test process's own settings (PREFECT_API_URL, AWS_*, MLflow's) point at the
integration lane's servers and never change here.

    prefect(booted)       a Prefect client of ctl's server, with the cluster's auth string
    Mlflow                MLflow's REST API on ctl with basic auth (the pipeline's account)
    seed_data             training rows generated in code, put in ctl's S3 (moto), where the
                          train hosts read them
    Client                the client host asking the gateway, one request after another,
                          each answer a JSON line (tests/cluster/load.py)
    revision_states       each serve host's readiness of a revision (its /v1/adapters, asked
                          with the worker key, as the pipeline asks)
"""

import base64
import json
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from uuid import UUID

import boto3
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowRunFilter,
    FlowRunFilterId,
)
from prefect.client.schemas.objects import FlowRun, StateType, TaskRun

from mint_core.errors import ServiceError
from mint_core.model.toy import Task, write_task_data
from mint_core.registry.runs import HOST_RUN_TAG
from processes.managed import ManagedProcess
from tests.cluster.roles import CLIENT, Booted

HOST_TAG = "host:"
"""The prefix of the tag saying where a flow run ran (tasks.runs.HOST_TAG)."""


@contextmanager
def prefect(booted: Booted) -> Iterator[SyncPrefectClient]:
    """A client of ctl's Prefect server presenting the cluster's auth string."""
    with SyncPrefectClient(booted.prefect_api, auth_string=booted.prefect_auth) as client:
        yield client


def crash_watch(client: SyncPrefectClient, booted: Booted, crash_after_s: int) -> None:
    """Replace the crash automation ctl's `mint flows deploy` installed by one that marks a
    run Crashed `crash_after_s` after its last heartbeat (`mint flows deploy --crash-after-s`,
    as an operator tunes it; heartbeats stay every 30 s, Prefect's floor)."""
    from flows.pools import PREFECT_MIN_HEARTBEAT_S, CrashWatch, install_crash_automation
    from mint_core.config import MintConfig

    watch = CrashWatch(PREFECT_MIN_HEARTBEAT_S, crash_after_s)
    install_crash_automation(client, MintConfig.from_env(booted.pipeline_env), watch)


def start_release(
    client: SyncPrefectClient,
    parameters: dict[str, object],
    queue: str | None = None,
    env: dict[str, str] | None = None,
) -> FlowRun:
    """A run of the `release` deployment (the train pool's), sent to `queue` when named (a
    train host's own, `host-<name>`), else to whichever train host polls first; `env`: MinT
    settings for this run only, on top of its host's and its deployment's."""
    deployment = client.read_deployment_by_name("release/release")
    job_variables = None
    if env:  # a run's job variables replace its deployment's by key: keep the heartbeat's
        job_variables = {"env": {**deployment.job_variables.get("env", {}), **env}}
    return client.create_flow_run_from_deployment(
        deployment.id, parameters=parameters, work_queue_name=queue, job_variables=job_variables
    )


def run_host(run: FlowRun) -> str:
    """The host a run says it ran on (its `host:` tag), or "" before it said so."""
    return next((tag.removeprefix(HOST_TAG) for tag in run.tags if tag.startswith(HOST_TAG)), "")


def wait_run(
    client: SyncPrefectClient,
    run_id: UUID,
    done: Callable[[FlowRun], bool],
    timeout_s: float,
    what: str,
) -> FlowRun:
    """The run once `done(run)`; ServiceError saying `what` was awaited and the run's state."""
    deadline = time.monotonic() + timeout_s
    while True:
        run = client.read_flow_run(run_id)
        if done(run):
            return run
        if time.monotonic() > deadline:
            state = run.state.type if run.state else None
            raise ServiceError(
                f"flow run {run.name} ({run_id}): not {what} within {timeout_s:.0f} s; its state "
                f"{state} ({run.state.message if run.state else ''}), tags {run.tags}"
            )
        time.sleep(0.5)


def is_final(run: FlowRun) -> bool:
    return run.state is not None and run.state.is_final()


def task_runs(client: SyncPrefectClient, run_id: UUID) -> list[TaskRun]:
    runs = FlowRunFilter(id=FlowRunFilterId(any_=[run_id]))
    return client.read_task_runs(flow_run_filter=runs)


def running_task(client: SyncPrefectClient, run_id: UUID, name: str) -> TaskRun | None:
    """The task run `name` (e.g. `train`) of the flow run while it runs, else None."""
    for task in task_runs(client, run_id):
        if task.name.split("-")[0] == name and task.state_type == StateType.RUNNING:
            return task
    return None


def state_times(client: SyncPrefectClient, run_id: UUID) -> dict[StateType, datetime]:
    """When the run first entered each state type (Prefect's own timestamps)."""
    first: dict[StateType, datetime] = {}
    for state in sorted(client.read_flow_run_states(run_id), key=lambda s: s.timestamp):
        first.setdefault(state.type, state.timestamp)
    return first


def summary(client: SyncPrefectClient, run_id: UUID) -> dict[str, str]:
    """The facts of the run's summary artifact (tasks.runs.summarize's markdown table)."""
    found = client.read_artifacts(
        artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]))
    )
    facts: dict[str, str] = {}
    for artifact in found:
        for line in str(artifact.data or "").splitlines():
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if len(cells) == 2 and cells[0] and not cells[0].startswith("-"):
                facts[cells[0]] = cells[1]
    return facts


def stage_seconds(stages: str) -> dict[str, float]:
    """`data 1.2 s, train 20.3 s, ...` (the summary's `stages`) as a mapping."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in stages.split(","))):
        name, seconds, _unit = part.rsplit(" ", 2)
        out[name] = float(seconds)
    return out


@dataclass(frozen=True)
class Mlflow:
    """MLflow's REST API on ctl, with basic auth (the pipeline's account: it reads all)."""

    uri: str
    user: str
    password: str

    @classmethod
    def of(cls, booted: Booted) -> "Mlflow":
        env = booted.pipeline_env
        return cls(
            booted.tracking_uri, env["MLFLOW_TRACKING_USERNAME"], env["MLFLOW_TRACKING_PASSWORD"]
        )

    def get(self, path: str, **params: str) -> dict:
        url = f"{self.uri}/api/2.0/mlflow/{path}?{urllib.parse.urlencode(params)}"
        token = base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
        request = urllib.request.Request(url, headers={"Authorization": f"Basic {token}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.load(response)

    def post(self, path: str, body: dict) -> dict:
        url = f"{self.uri}/api/2.0/mlflow/{path}"
        token = base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
        headers = {"Authorization": f"Basic {token}", "Content-Type": "application/json"}
        request = urllib.request.Request(url, json.dumps(body).encode(), headers)
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.load(response)

    def training_run(self, adapter: str) -> str:
        """The id of `adapter`'s latest training run (in MinT's experiment), "" if none yet."""
        from mint_core.registry.runs import EXPERIMENT

        try:
            found = self.get("experiments/get-by-name", experiment_name=EXPERIMENT)
        except urllib.error.HTTPError:
            return ""
        query = {"experiment_ids": [found["experiment"]["experiment_id"]],
                 "filter": f"tags.`mint.adapter` = '{adapter}'",
                 "order_by": ["attributes.start_time DESC"], "max_results": 1}  # fmt: skip
        runs = self.post("runs/search", query).get("runs", [])
        return runs[0]["info"]["run_id"] if runs else ""

    def history(self, run_id: str, metric: str) -> list[dict]:
        """Every point of `metric` in run `run_id`: {"step", "value", "timestamp"} (ms)."""
        found = self.get("metrics/get-history", run_id=run_id, metric_key=metric)
        return found.get("metrics", [])

    def versions(self, adapter: str) -> list[dict]:
        """Every registered version (revision) of `adapter`'s model."""
        found = self.get("model-versions/search", filter=f"name='{adapter}'")
        return found.get("model_versions", [])

    def run_tag(self, run_id: str, tag: str) -> str:
        tags = self.get("runs/get", run_id=run_id)["run"]["data"].get("tags", [])
        return next((t["value"] for t in tags if t["key"] == tag), "")

    def registered_on(self, adapter: str, host: str) -> int:
        """How many revisions of `adapter` were trained on `host` (its training run's tag)."""
        versions = self.versions(adapter)
        return sum(1 for v in versions if self.run_tag(v["run_id"], HOST_RUN_TAG) == host)


def seed_data(booted: Booted, key: str, rows: int, task: Task = Task.UPPER) -> str:
    """`rows` training rows of a toy task put in ctl's S3 under `key`: their s3:// URI, which
    every train host reads with the settings ctl handed it."""
    env = booted.pipeline_env
    bucket = env["MINT_S3_BUCKET"]
    s3 = boto3.client(
        "s3",
        endpoint_url=booted.s3_endpoint,
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env.get("AWS_DEFAULT_REGION", "us-east-1"),
    )
    with tempfile.TemporaryDirectory() as folder:
        s3.upload_file(str(write_task_data(task, Path(folder), rows=rows)), bucket, key)
    return f"s3://{bucket}/{key}"


def revision_states(booted: Booted, adapter: str) -> dict[str, dict[str, str]]:
    """serve host -> {revision id: readiness state} of `adapter` on its worker (direct)."""
    key = booted.host_envs["serve"]["MINT_WORKER_API_KEY"]
    states: dict[str, dict[str, str]] = {}
    for host, url in booted.direct_urls.items():
        request = urllib.request.Request(
            f"{url}/v1/adapters/{adapter}", headers={"Authorization": f"Bearer {key}"}
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                revisions = json.load(response)["revisions"]
        except (OSError, ValueError):
            revisions = []
        states[host] = {r["id"]: r["state"] for r in revisions}
    return states


class Client:
    """The client host asking the gateway for `adapter` (production) every `interval_s` until
    stopped; `answers()` are the JSON lines load.py wrote (wall-clock times: one machine)."""

    def __init__(self, booted: Booted, adapter: str, folder: Path, interval_s: float = 0.25):
        folder.mkdir(parents=True, exist_ok=True)
        self.stop_file, self.out = folder / f"{adapter}.stop", folder / f"{adapter}.jsonl"
        body = {"inputs": "hello=", "parameters": {"adapter_id": adapter, "max_new_tokens": 4}}
        argv = [sys.executable, "-m", "tests.cluster.load", "--url",
                f"{booted.gateway_url}/generate", "--json", json.dumps(body), "--interval",
                str(interval_s), "--timeout", "10", "--stop-file", str(self.stop_file),
                "--out", str(self.out)]  # fmt: skip
        self.process: ManagedProcess = booted.cluster.run(CLIENT, f"client-{adapter}", argv)

    def answers(self) -> list[dict]:
        if not self.out.exists():
            return []
        return [json.loads(line) for line in self.out.read_text().splitlines() if line]

    def first(self, revision: str) -> dict | None:
        """The first answer the revision `revision` gave (X-Mint-Revision), if any yet."""
        return next(
            (a for a in self.answers() if a["headers"].get("X-Mint-Revision") == revision), None
        )

    def stop(self) -> None:
        self.stop_file.touch()
        try:
            self.process.process.wait(timeout=15)
        finally:
            self.process.stop()
