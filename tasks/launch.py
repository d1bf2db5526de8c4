"""Training on the ranks a launch asks for: torchrun on this host (node 0, where global rank 0
runs) and, for more than one node, a `train-node` flow run per other node in the train pool.
A train host's worker runs one flow run at a time, so while this run holds its host the
others land on other train hosts. Rank 0's events come back here as the same callbacks an
in-process training calls, so MLflow and the run's log read alike either way."""

import shutil
import uuid
from dataclasses import fields
from functools import partial
from uuid import UUID

from prefect import get_client
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from prefect.states import Cancelled

from mint_core.config import MintConfig
from mint_core.distributed import HOST_ENV, Launch, check_shares, endpoint_parts
from mint_core.errors import ConfigurationError
from mint_core.model.training import (
    StartCallback,
    StepCallback,
    TrainedAdapter,
    TrainingConfig,
    TrainJob,
)
from processes import free_port
from processes.torchrun import start_ranks
from tasks.runs import run_log

ENTRY = "mint_core.model.training:train_rank"
NODE_DEPLOYMENT = "train-node/train-node"
"""The deployment each node but the first runs as (`flows.train_node`), in the train pool."""
LOOPBACK = "127.0.0.1"


def train_on_ranks(
    config: MintConfig,
    launch: Launch,
    job: TrainJob,
    on_step: StepCallback,
    on_start: StartCallback,
) -> TrainedAdapter:
    """`job` trained on `launch`'s ranks; TrainingFailedError if any rank fails or is lost
    (every rank is then stopped, by torchrun here and by its own torchrun on other hosts)."""
    check_shares(job.config.batch_size, launch.world_size)
    master = rendezvous(config, launch)
    name = uuid.uuid4().hex[:12]
    run_dir = config.work_root / "ranks" / name
    log = run_log()
    log.info(
        "training on %d processes (%d host(s) x %d), rendezvous at %s:%d, timeout %.0f s",
        launch.world_size,
        launch.nnodes,
        launch.nproc_per_node,
        *master,
        launch.timeout_s,
    )
    nodes = start_nodes(launch, master, name)
    try:
        env = {HOST_ENV: config.host_name}
        with start_ranks(launch, run_dir, master, job=(ENTRY, job), env=env) as ranks:
            trained = ranks.result(partial(_on_event, on_step, on_start))
    finally:
        stop_nodes(nodes)
    assert isinstance(trained, TrainedAdapter)
    log.info("trained on %s", trained.world.describe())
    shutil.rmtree(run_dir, ignore_errors=True)  # kept on failure: its rank logs say why
    return trained


def join_launch(config: MintConfig, launch: Launch, name: str, node_rank: int) -> None:
    """Node `node_rank` of the launch `name` whose node 0 is at `launch.rdzv_endpoint`: its
    ranks, until they end (TrainingFailedError if any fails)."""
    master = endpoint_parts(launch.rdzv_endpoint)
    run_dir = config.work_root / "ranks" / f"{name}-node{node_rank}"
    run_log().info(
        "node %d of %d on %s: %d processes, rendezvous at %s:%d",
        node_rank,
        launch.nnodes,
        config.host_name,
        launch.nproc_per_node,
        *master,
    )
    env = {HOST_ENV: config.host_name}
    with start_ranks(launch, run_dir, master, node_rank=node_rank, env=env) as ranks:
        ranks.result()
    shutil.rmtree(run_dir, ignore_errors=True)


def rendezvous(config: MintConfig, launch: Launch) -> tuple[str, int]:
    """Node 0's (address, port): the endpoint given, else this train host's address (one
    node: loopback) and a free port."""
    if launch.rdzv_endpoint:
        host, port = endpoint_parts(launch.rdzv_endpoint)
        return host, port or free_port()
    if launch.nnodes == 1:
        return LOOPBACK, free_port()
    if not config.train_address:
        raise ConfigurationError(
            f"nnodes={launch.nnodes}: the other train hosts need this one's address; set "
            "MINT_TRAIN_ADDRESS (`mint up --role train --host ADDRESS` sets it) or pass "
            "rdzv_endpoint (--rdzv-endpoint HOST:PORT)"
        )
    return config.train_address, free_port()


def start_nodes(launch: Launch, master: tuple[str, int], name: str) -> list[UUID]:
    """A `train-node` flow run for each node but this one (none for one node)."""
    runs = []
    for node_rank in range(1, launch.nnodes):
        parameters = {
            "name": name,
            "node_rank": node_rank,
            "rdzv_endpoint": "{}:{}".format(*master),
            "nproc_per_node": launch.nproc_per_node,
            "nnodes": launch.nnodes,
            "dist_timeout_s": launch.timeout_s,
        }
        try:
            run = run_deployment(NODE_DEPLOYMENT, parameters=parameters, timeout=0)
        except ObjectNotFound:
            stop_nodes(runs)
            raise ConfigurationError(
                f"nnodes={launch.nnodes} needs the {NODE_DEPLOYMENT} deployment on the train "
                "pool: run `mint flows deploy` on the control host and `mint up --role train` "
                "on each train host (or `mint flows serve` on one machine)"
            ) from None
        runs.append(run.id)  # type: ignore[union-attr]
    return runs


def stop_nodes(runs: list[UUID]) -> None:
    """Cancel the node runs that have not ended: one never picked up (no free train host)
    must not start after its launch is gone, and one still waiting at the rendezvous would
    hold its host until the timeout. One that ended (with its ranks) is left as it is."""
    with get_client(sync_client=True) as client:
        for run_id in runs:
            state = client.read_flow_run(run_id).state
            if state is not None and not state.is_final():
                client.set_flow_run_state(run_id, Cancelled(), force=True)


def _on_event(on_step: StepCallback, on_start: StartCallback, event: dict[str, object]) -> None:
    if "started" in event:
        on_start(_training_config(event["started"]))  # type: ignore[arg-type]
    elif "step" in event:
        on_step(int(event["step"]), int(event["total"]), float(event["loss"]))  # type: ignore[arg-type]
    elif "allreduce_s" in event:
        run_log().info("the gradients' all-reduce took %.2f s in all", event["allreduce_s"])


def _training_config(values: dict[str, object]) -> TrainingConfig:
    """A TrainingConfig from its JSON form (lists back to tuples)."""
    known = {f.name for f in fields(TrainingConfig)}
    tuples = {"target_modules", "expert_targets"}
    return TrainingConfig(
        **{
            k: tuple(v) if k in tuples and v is not None else v
            for k, v in values.items()
            if k in known
        }  # type: ignore[arg-type]
    )
