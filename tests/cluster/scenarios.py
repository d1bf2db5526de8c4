"""The release and train-host scenarios on the booted cluster (tests/cluster/roles.py), as
drivers returning frozen figures: the tests assert on them, bench/cluster.py records them.

    release_across_hosts   a release started through ctl's Prefect API runs on a train host,
                           registers on ctl, is admitted and prewarmed on both serve hosts and
                           activated; the client host sees its revision through the gateway
    training_through       a release trains on a train host while something is done to the
                           cluster (ctl cut off): its steps' times and its run's loss curve
    train_host_killed      the train host running a release dies mid-training (every process
                           in it SIGKILLed); the crash automation ends the run, nothing was
                           registered, the roll-out slot is free, and a rerun sent to the other
                           train host's own queue succeeds there. The killed host stays dead:
                           run it last (no later scenario needs a train host)
"""

import itertools
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.exceptions import ObjectNotFound

from mint_core.errors import ServiceError
from tests.cluster import drive, roles
from tests.cluster.roles import Booted

T = TypeVar("T")

RUN_TIMEOUT_S = 420.0
"""A release on a busy 2-core machine: the flow process starts, loads torch and the base,
trains, exports, and both workers admit and prewarm."""

CRASH_AFTER_S = 61
"""The crash watch for the train-host scenario: a run is marked Crashed 61 s after its last
heartbeat (every 30 s, Prefect's floor) rather than the default 90 s. The least that allows
one late heartbeat (CrashWatch wants more than one interval); what the lane waits for."""

CRASH_TIMEOUT_S = 180.0
"""A heartbeat's interval, the crash window and the automation's evaluation (every few
seconds), with room for a busy server."""

SEEN_TIMEOUT_S = 60.0
"""How long after the run ended the client may take to see the new revision (the gateway
reads the catalog every second or so)."""


@dataclass(frozen=True)
class ReleaseFigures:
    total_s: float
    """From create_flow_run_from_deployment to the client's first answer by the revision."""
    stage_s: dict[str, float]
    """scheduled->running (Prefect's state times), the run's stages (its summary), and
    client_sees: from the run's Completed state to the client's first answer by the revision
    (below 0: the client saw it before the run had written its summary and ended)."""
    flow_run_host: str
    serve_hosts_ready: int
    revision: str = ""

    def as_json(self) -> dict[str, object]:
        return {"release": asdict(self)}


@dataclass(frozen=True)
class TrainKilledFigures:
    killed_host: str
    registered: int
    """Revisions trained on the killed host that were registered (its training run's tag)."""
    final_state: str
    crash_detected_s: float
    """From the kill until the test saw the killed run in a final state (polled every 0.5 s;
    the state's own timestamp, which Prefect's automation sets, is in `notes`)."""
    slot_free: bool
    """No roll-out slot of the adapter held just after the kill."""
    rerun_ok: bool
    rerun_host: str
    rerun_revision: str = ""
    killed_pids: int = 0
    notes: dict[str, str] = field(default_factory=dict)

    def as_json(self) -> dict[str, object]:
        return {"train_killed": asdict(self)}


def release_parameters(adapter: str, data: str, steps: int) -> dict[str, object]:
    return {"adapter": adapter, "data": data, "steps": steps, "actor": "cluster-test"}


def release_across_hosts(
    booted: Booted,
    folder: Path,
    adapter: str = "xh-bot",
    steps: int = 20,
    rows: int = 96,
    launch: Mapping[str, object] | None = None,
) -> ReleaseFigures:
    """Release `adapter` (trained `steps` steps on `rows` toy rows seeded into ctl's S3)
    through ctl's Prefect API, with the client host asking the gateway for it meanwhile;
    `launch`: the release's distributed parameters (`nnodes`, `nproc_per_node`, ...)."""
    data = drive.seed_data(booted, f"cluster/{adapter}/train.jsonl", rows)
    client = drive.Client(booted, adapter, folder)
    try:
        with drive.prefect(booted) as prefect:
            started = time.time()
            params = release_parameters(adapter, data, steps) | dict(launch or {})
            # Placed on both workers (MINT_REPLICAS, for this run only): both admit and prewarm.
            replicas = {"MINT_REPLICAS": str(len(roles.SERVE))}
            run = drive.start_release(prefect, params, env=replicas)
            run = drive.wait_run(prefect, run.id, drive.is_final, RUN_TIMEOUT_S, "final")
            _check_completed(run, booted)
            facts = drive.summary(prefect, run.id)
            times = drive.state_times(prefect, run.id)
        revision = facts["revision"]
        seen = _wait_seen(client, revision, SEEN_TIMEOUT_S)
    finally:
        client.stop()
    stages = {
        "scheduled->running": _between(times, StateType.SCHEDULED, StateType.RUNNING),
        **drive.stage_seconds(facts.get("stages", "")),
        "client_sees": round(seen["t_end"] - times[StateType.COMPLETED].timestamp(), 3),
    }
    ready = drive.revision_states(booted, adapter)
    return ReleaseFigures(
        total_s=round(seen["t_end"] - started, 3),
        stage_s=stages,
        flow_run_host=drive.run_host(run),
        serve_hosts_ready=sum(1 for s in ready.values() if s.get(revision) == "ready"),
        revision=revision,
    )


def train_host_killed(
    booted: Booted,
    adapter: str = "tk-bot",
    steps: int = 5000,
    rerun_steps: int = 20,
    crash_after_s: int = CRASH_AFTER_S,
) -> TrainKilledFigures:
    """With the crash watch at `crash_after_s`, start a long release (`steps`), SIGKILL every
    process of the train host it runs on once its train task runs, and at once send a short
    rerun (`rerun_steps`) to the other train host's own queue; return once both have ended."""
    data = drive.seed_data(booted, f"cluster/{adapter}/train.jsonl", 96)
    mlflow = drive.Mlflow.of(booted)
    with drive.prefect(booted) as prefect:
        drive.crash_watch(prefect, booted, crash_after_s)
        run = drive.start_release(prefect, release_parameters(adapter, data, steps))
        run = drive.wait_run(
            prefect, run.id, lambda r: _training(prefect, r), RUN_TIMEOUT_S, "training"
        )
        host = drive.run_host(run)
        killed_at = time.time()
        killed = booted.cluster.kill_host(host)
        slot_free = _slot_free(prefect, adapter)
        (other,) = [h for h in roles.TRAIN if h != host]
        params = release_parameters(adapter, data, rerun_steps)
        rerun = drive.start_release(prefect, params, queue=f"host-{other}")
        run = drive.wait_run(prefect, run.id, drive.is_final, CRASH_TIMEOUT_S, "final")
        seen_final = time.time()
        ended = drive.state_times(prefect, run.id)[run.state_type]  # type: ignore[index]
        rerun = drive.wait_run(prefect, rerun.id, drive.is_final, RUN_TIMEOUT_S, "final")
        _check_completed(rerun, booted)
        rerun_revision = drive.summary(prefect, rerun.id).get("revision", "")
    assert run.state is not None and rerun.state is not None
    return TrainKilledFigures(
        killed_host=host,
        registered=mlflow.registered_on(adapter, host),
        final_state=str(run.state.type.value),
        crash_detected_s=round(seen_final - killed_at, 1),
        slot_free=slot_free,
        rerun_ok=rerun.state.is_completed() and bool(rerun_revision),
        rerun_host=drive.run_host(rerun),
        rerun_revision=rerun_revision,
        killed_pids=len(killed),
        notes={
            "killed_run": run.state.message or "",
            "rerun_queue": f"host-{other}",
            "final_state_stamped_s": f"{ended.timestamp() - killed_at:.1f}",
        },
    )


def _training(prefect: SyncPrefectClient, run: FlowRun) -> bool:
    """Whether the run said which host it is on and its train task is running."""
    if drive.is_final(run):
        raise ServiceError(f"flow run {run.name} ended before training: {run.state}")
    return bool(drive.run_host(run)) and drive.running_task(prefect, run.id, "train") is not None


def _slot_free(prefect: SyncPrefectClient, adapter: str) -> bool:
    try:
        limit = prefect.read_global_concurrency_limit_by_name(f"mint-rollout-{adapter}")
    except ObjectNotFound:
        return True  # never taken: made on first use
    return limit.active_slots == 0


def _between(times: dict[StateType, object], start: StateType, end: StateType) -> float:
    return round(times[end].timestamp() - times[start].timestamp(), 3)  # type: ignore[attr-defined]


def _wait_seen(client: drive.Client, revision: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while (seen := client.first(revision)) is None:
        if time.monotonic() > deadline:
            last = client.answers()[-3:]
            raise ServiceError(
                f"the client never got an answer by {revision} within {timeout_s:.0f} s of "
                f"the run's end; its last answers: {last}"
            )
        time.sleep(0.25)
    return seen


def _check_completed(run: FlowRun, booted: Booted) -> None:
    if run.state is not None and run.state.is_completed():
        return
    logs = {h: booted.cluster.state_dir / h for h in roles.TRAIN}
    raise ServiceError(
        f"flow run {run.name} ({run.id}) ended {run.state}; the train hosts' logs: {logs}"
    )


@dataclass(frozen=True)
class TrainingFigures:
    steps: int
    completed: bool
    """The release ended Completed (registered, rolled out) once the cluster was whole again."""
    losses_once_in_order: bool
    """The run's train_loss has each step 1..steps exactly once, stamped in step order."""
    steps_in_window: int
    """Steps stamped (when taken, on the train host) inside the window the cluster was changed."""
    longest_pause_s: float
    """The longest time between two consecutive steps inside the window."""
    window_s: float
    revision: str = ""

    def as_json(self) -> dict[str, object]:
        return {"training_through": asdict(self)}


def training_through(
    booted: Booted, act: Callable[[], T], adapter: str = "cut-train-bot", steps: int = 3000
) -> tuple[T, TrainingFigures]:
    """Start a release of `adapter` (`steps` steps), and once it has logged its first losses do
    `act()` (which must leave the cluster whole); then wait for the release and read its run's
    loss curve: what `act` returned and the training's figures over the window `act` took."""
    data = drive.seed_data(booted, f"cluster/{adapter}/train.jsonl", 96)
    mlflow = drive.Mlflow.of(booted)
    with drive.prefect(booted) as prefect:
        run = drive.start_release(prefect, release_parameters(adapter, data, steps))
        deadline = time.monotonic() + RUN_TIMEOUT_S
        run_id = ""
        while not (run_id and mlflow.history(run_id, "train_loss")):
            if drive.is_final(prefect.read_flow_run(run.id)) or time.monotonic() > deadline:
                raise ServiceError(f"release {run.name} logged no loss: {run.state}")
            time.sleep(0.5)
            run_id = run_id or mlflow.training_run(adapter)
        started = time.time()
        result = act()
        ended = time.time()
        run = drive.wait_run(prefect, run.id, drive.is_final, RUN_TIMEOUT_S, "final")
        revision = drive.summary(prefect, run.id).get("revision", "")
    history = sorted(
        mlflow.history(run_id, "train_loss"), key=lambda m: (m["timestamp"], m["step"])
    )
    stamps = [m["timestamp"] / 1000 for m in history]
    inside = [t for t in stamps if started <= t <= ended]
    pauses = [b - a for a, b in itertools.pairwise(stamps) if b >= started and a <= ended]
    return result, TrainingFigures(
        steps=steps,
        completed=run.state is not None and run.state.is_completed(),
        losses_once_in_order=[int(m["step"]) for m in history] == list(range(1, steps + 1)),
        steps_in_window=len(inside),
        longest_pause_s=round(max(pauses, default=ended - started), 3),
        window_s=round(ended - started, 3),
        revision=revision,
    )
