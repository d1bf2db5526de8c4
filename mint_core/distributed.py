"""Training on several processes with torch.distributed: the launch's options and each rank's
side of it.

`processes.torchrun` starts torchrun on every node (`python -m torch.distributed.run ... -m
mint_core.distributed RUN_DIR`, static rendezvous: node 0 is the driver's, so global rank 0
runs beside the process that launched it). Rank 0 reads the job the driver left in RUN_DIR and
broadcasts it to every rank (a node other than 0 has nothing on its disk); rank 0 alone writes
progress events and the result back there, so the driver (a flow run) speaks to MLflow and
Prefect and no rank does. Only the LoRA's gradients travel: one flat all-reduce per step.
"""

import json
import logging
import os
import pickle
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from importlib import import_module
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from mint_core.errors import ConfigurationError, MintError
from mint_core.revisions import TAG_PREFIX

JOB = "job.pkl"
"""(entry, payload) the driver leaves for rank 0: entry is `module:function(payload, rank)`."""
EVENTS = "events.jsonl"
"""Rank 0's progress, a JSON object per line, read by the driver as it is written."""
RESULT = "result.pkl"
"""What the entry returned on rank 0."""
FAILURE = "failure.json"
"""A MinT error raised on rank 0, as {"type", "message"}: the driver raises it again."""
COMMAND = "command-{}.pkl"
REPLY = "reply-{}.pkl"
"""A long-lived job's (the rl flow's policy update) requests and rank 0's answers, in order."""
TIMEOUT_ENV = "MINT_DIST_TIMEOUT_S"
HOST_ENV = "MINT_HOST"
DEFAULT_TIMEOUT_S = 300.0
"""torch.distributed's timeout for the rendezvous and every collective: a rank lost without a
closed connection (its host cut off) fails the others after this long instead of never."""
POLL_S = 0.02

T = TypeVar("T")


@dataclass(frozen=True)
class Launch:
    """How many processes train and where, as torchrun takes it. One process (the default)
    trains in the flow run's own process, as it always has."""

    nproc_per_node: int = 1
    nnodes: int = 1
    rdzv_endpoint: str = ""
    """HOST[:PORT] of node 0 (the flow run's host), as other nodes reach it; empty: one node
    on loopback, or with several, the train host's own address (MINT_TRAIN_ADDRESS)."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    shard_base: bool = False
    """Shard the frozen base over the ranks with FSDP2 (a base larger than one device)."""

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1 or self.nnodes < 1:
            raise ConfigurationError(
                f"nproc_per_node={self.nproc_per_node} and nnodes={self.nnodes} must be at least 1"
            )
        if not self.timeout_s > 0:
            raise ConfigurationError(f"distributed timeout_s={self.timeout_s} must be > 0")
        if self.rdzv_endpoint:
            endpoint_parts(self.rdzv_endpoint)

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def in_process(self) -> bool:
        """One process and nothing sharded: train in the caller's process, as always."""
        return self.world_size == 1 and not self.shard_base

    def params(self) -> dict[str, str]:
        return {"world_size": str(self.world_size)} | {
            name: str(value) for name, value in asdict(self).items()
        }


ONE_PROCESS = Launch()
"""The default: training in the caller's own process."""


def endpoint_parts(endpoint: str, default_port: int = 0) -> tuple[str, int]:
    """(host, port) of `HOST[:PORT]`; ConfigurationError naming it when it is neither."""
    host, _, port = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", "")
    if not host or (port and not port.isdigit()) or (port and not 0 < int(port) < 65536):
        raise ConfigurationError(
            f"rendezvous endpoint {endpoint!r} is not HOST[:PORT] (e.g. 10.0.0.5:29500): the "
            "address of node 0, the host the flow run trains on, as the other nodes reach it"
        )
    return host, int(port) if port else default_port


def check_shares(batch_size: int, world_size: int) -> None:
    """Every process takes a share of every batch: refused before any starts if some would
    get no row."""
    if batch_size < world_size:
        raise ConfigurationError(
            f"batch_size={batch_size} is smaller than the {world_size} training processes: "
            f"each takes a share of every batch; use a batch size of at least {world_size} "
            "or fewer processes"
        )


@dataclass(frozen=True)
class World:
    """How a revision was trained: what its policy record and MLflow run say."""

    size: int = 1
    hosts: tuple[str, ...] = ()
    """Each node's host name (MINT_HOST), node 0 first."""
    backend: str = ""
    """torch.distributed's backend (gloo on CPUs, nccl between GPUs); empty: one process."""
    sharded_base: bool = False

    def policy_fields(self) -> dict[str, object]:
        return {
            "world_size": self.size,
            "train_hosts": list(self.hosts),
            "dist_backend": self.backend or "none",
            "sharded_base": self.sharded_base,
        }

    def describe(self) -> str:
        """E.g. "2 processes on train-1, train-2 (gloo)"."""
        sharded = ", base sharded" if self.sharded_base else ""
        return f"{self.size} processes on {', '.join(self.hosts)} ({self.backend}{sharded})"

    def tags(self) -> dict[str, str]:
        """What the MLflow training run is tagged with (the hosts are known once all joined)."""
        fields = self.policy_fields()
        return {
            TAG_PREFIX + "world_size": str(self.size),
            TAG_PREFIX + "train_hosts": ",".join(self.hosts),
            TAG_PREFIX + "dist_backend": str(fields["dist_backend"]),
        }


class Rank:
    """This process's place among the ranks, and the few collectives training needs."""

    def __init__(self, run_dir: Path) -> None:
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.backend = str(dist.get_backend())
        self.run_dir = run_dir
        self.device = (
            f"cuda:{self.local_rank}" if self.backend == "nccl" else ""
        )  # "": the base's own choice (the CPU here)
        self.allreduce_s = 0.0
        """Time spent in the gradient all-reduce, summed over steps (the benchmark's share)."""
        self._commands = 0

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def world(self, sharded_base: bool = False) -> World:
        """Every node's host name, gathered (a collective: every rank calls it)."""
        host = os.environ.get(HOST_ENV) or socket.gethostname()
        hosts: list[str | None] = [None] * self.size
        dist.all_gather_object(hosts, host)
        nodes = list(dict.fromkeys(h for h in hosts if h))
        return World(self.size, tuple(nodes), self.backend, sharded_base)

    def shard(self, items: Sequence[T]) -> list[T]:
        """This rank's share of `items` (every size-th, from its rank): of one global batch,
        so every rank takes a step on the same rows as one process would."""
        return list(items[self.rank :: self.size])

    def all_reduce_grads(self, parameters: Sequence[torch.nn.Parameter]) -> None:
        """Sum `parameters`' gradients over the ranks in one flat all-reduce: the LoRA's only
        (a few MB; the frozen base has no gradients), once per optimizer step."""
        started = time.perf_counter()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for p, g in zip(parameters, grads, strict=True):
            p.grad = flat[offset : offset + g.numel()].view_as(g)
            offset += g.numel()
        self.allreduce_s += time.perf_counter() - started

    def sum(self, value: float) -> float:
        # On the rank's device: NCCL reduces no CPU tensor.
        total = torch.tensor([value], dtype=torch.float64, device=self.device or "cpu")
        dist.all_reduce(total)
        return float(total.item())

    def broadcast(self, value: T | None) -> T:
        """Rank 0's `value` on every rank."""
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]  # type: ignore[return-value]

    def emit(self, **event: object) -> None:
        """A progress event for the driver (rank 0's; the others' are dropped: one voice)."""
        if self.leader:
            with (self.run_dir / EVENTS).open("a") as events:
                events.write(json.dumps(event) + "\n")

    def receive(self) -> object:
        """The driver's next request, on every rank (rank 0 waits for it, then broadcasts)."""
        request = None
        if self.leader:
            path = self.run_dir / COMMAND.format(self._commands)
            while not path.exists():
                time.sleep(POLL_S)
            request = pickle.loads(path.read_bytes())
        self._commands += 1
        return self.broadcast(request)

    def reply(self, answer: object) -> None:
        """Rank 0's answer to the last request."""
        if self.leader:
            write_atomic(self.run_dir / REPLY.format(self._commands - 1), pickle.dumps(answer))


def write_atomic(path: Path, data: bytes) -> None:
    """`data` at `path` all at once: a reader polling for it never sees half."""
    partial = path.with_name(path.name + ".part")
    partial.write_bytes(data)
    partial.replace(path)


def _entry(name: str) -> Callable[[object, Rank], object]:
    module, _, function = name.partition(":")
    return getattr(import_module(module), function)


def main(run_dir: Path) -> None:
    """One rank: join the group, run the job, leave. A MinT error on rank 0 is written for the
    driver to raise again; any error ends this process non-zero, which ends torchrun's."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))
    dist.init_process_group(backend, timeout=timeout)
    rank = Rank(run_dir)
    try:
        job = pickle.loads((run_dir / JOB).read_bytes()) if rank.leader else None
        entry, payload = rank.broadcast(job)
        result = _entry(entry)(payload, rank)
        if rank.leader:
            write_atomic(run_dir / RESULT, pickle.dumps(result))
    except MintError as e:
        if rank.leader:
            failure = {"type": type(e).__name__, "message": str(e)}
            write_atomic(run_dir / FAILURE, json.dumps(failure).encode())
        raise
    finally:
        dist.destroy_process_group()


def end(run: Callable[[], None]) -> None:
    """Run a rank's `run`, then end its process at once, with the status it earned: the
    interpreter's teardown is skipped. A process group's gloo threads outlive
    destroy_process_group wherever something still holds the group (FSDP2's device mesh does;
    so does torch._dynamo imported after joining), and their teardown racing the
    interpreter's crashed ranks whose job had succeeded, now and then (CI: SIGABRT
    "terminate called without an active exception", SIGBUS)."""
    code = 1
    try:
        run()
        code = 0
    except BaseException:  # every failure is this process's exit status
        traceback.print_exc()
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    from mint_core import distributed  # not __main__'s copy: what ranks return must unpickle

    # record: a rank's traceback reaches torchrun's failure summary, which the driver shows.
    end(lambda: record(distributed.main)(Path(sys.argv[1])))
