"""Training on 2 processes (torchrun, gloo on CPU) through `processes.torchrun`: the adapter
and losses are one process's whatever the world size, a rank killed mid-training fails the
step in bounded time leaving nothing behind (no result, no adapter, no process). (A rank's
own ConfigurationError coming back as itself is tests/unit/test_distributed_launch.py's.)

What differs between 1 and 2 processes is only the order of float32 sums: each rank sums its
share of a batch's token losses (and their gradients), and the all-reduce adds the shares, where
one process sums the whole batch at once. Measured (6 steps, learning rate 1e-3, seeds 0 and 7):
LoRA tensors differ by at most 2.4e-8 and step losses (about 5.5) by 6e-7, a float32 step or
so. A real fault (a rank's share lost or counted twice) moves them by about the learning rate.
"""

import atexit
import os
import signal
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from safetensors.torch import load_file

from mint_core.distributed import RESULT, Launch, Rank
from mint_core.errors import TrainingFailedError
from mint_core.model import toy
from mint_core.model.base import BaseSource
from mint_core.model.datasets import Dataset, parse_jsonl
from mint_core.model.tiny import TinySpec, ensure_tiny
from mint_core.model.training import TrainingConfig, TrainJob, train_lora
from processes import free_port
from processes.torchrun import Ranks, start_ranks

pytestmark = pytest.mark.slow

TINY = TinySpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, pretrain_steps=0)
CONFIG = TrainingConfig(steps=6, batch_size=8, gradient_accumulation=2, learning_rate=1e-3, seed=7)
"""A small learning rate: Adam divides a gradient by its own size, so where one is near 0 its
rounding can move a weight by up to the learning rate (at 1e-2 tensors differed by 1.3e-6)."""
TOLERANCE = 1e-5
"""Largest difference allowed in a LoRA weight or a step's loss: over 15x the largest measured
(2.4e-8 and 6e-7), 100x below a real fault's."""
TWO = Launch(nproc_per_node=2)
ENTRY = "mint_core.model.training:train_rank"
FAILED_WITHIN_S = 60.0
"""A killed rank's step fails well within this (measured: 3 s at load 9 on 2 cores): gloo
sees the closed connection at once and torchrun, watching every 0.5 s, stops the other rank.
Far below the 300 s collective timeout (`Launch.timeout_s`), so a pass shows the loss was
noticed, not waited out; roomy for teardown on 2 loaded cores."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[BaseSource, Path]:
    """A tiny untrained base folder and the MINT_HOME it was built in."""
    home = tmp_path_factory.mktemp("home")
    return BaseSource(str(ensure_tiny(TINY, home / "base"))), home


@pytest.fixture(scope="module")
def upper_rows(tmp_path_factory: pytest.TempPathFactory) -> tuple[Dataset, Dataset]:
    folder = tmp_path_factory.mktemp("data")

    def read(path: Path) -> Dataset:
        return parse_jsonl(path.read_bytes(), str(path))

    return (
        read(toy.write_task_data(toy.Task.UPPER, folder, rows=64)),
        read(toy.write_held_out_data(toy.Task.UPPER, folder, count=8)),
    )


def launch(
    tiny: tuple[BaseSource, Path],
    rows: tuple[Dataset, Dataset],
    folder: Path,
    config: TrainingConfig,
) -> Ranks:
    job = TrainJob(*tiny, *rows, folder / "adapter", config)
    return start_ranks(TWO, folder / "run", ("127.0.0.1", free_port()), job=(ENTRY, job))


def test_two_processes_train_the_adapter_one_trains(
    tiny: tuple[BaseSource, Path], upper_rows: tuple[Dataset, Dataset], tmp_path: Path
) -> None:
    one = train_lora(*tiny, *upper_rows, tmp_path / "one", CONFIG)
    events: list[dict[str, object]] = []
    with launch(tiny, upper_rows, tmp_path / "two", CONFIG) as ranks:
        two = ranks.result(events.append)

    assert two.world.size == 2 and two.world.backend == "gloo" and not two.world.sharded_base
    assert one.world.size == 1 and one.world.backend == ""
    expected = load_file(one.path / "adapter_model.safetensors")
    got = load_file(two.path / "adapter_model.safetensors")
    assert expected.keys() == got.keys()
    assert max((expected[k] - got[k]).abs().max().item() for k in expected) < TOLERANCE
    assert two.steps == one.steps == CONFIG.steps
    assert max(abs(a - b) for a, b in zip(one.losses, two.losses, strict=True)) < TOLERANCE
    assert one.config == two.config  # the same targets resolved on the base
    # Rank 0 alone speaks: each step once, as the driver shows it.
    steps = [e for e in events if "step" in e]
    assert [e["step"] for e in steps] == list(range(1, CONFIG.steps + 1))
    assert [e["loss"] for e in steps] == list(two.losses)


def test_a_killed_rank_fails_the_step_in_bounded_time_leaving_nothing(
    tiny: tuple[BaseSource, Path], upper_rows: tuple[Dataset, Dataset], tmp_path: Path
) -> None:
    long = TrainingConfig(steps=400, batch_size=8, gradient_accumulation=2, seed=7)
    with launch(tiny, upper_rows, tmp_path, long) as ranks:
        deadline = time.monotonic() + 300
        while not any("step" in event for event in ranks.events()):
            assert ranks.process.poll() is None, "torchrun exited before the first step"
            assert time.monotonic() < deadline, "no step within 300 s"
            time.sleep(0.1)
        pids = rank_pids(tmp_path / "run")
        assert sorted(pids) == [0, 1]

        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        while ranks.process.poll() is None and time.monotonic() < killed + FAILED_WITHIN_S:
            time.sleep(0.1)
        failed_in = time.monotonic() - killed
        assert failed_in < FAILED_WITHIN_S, f"the step still ran {failed_in:.0f} s on"
        with pytest.raises(TrainingFailedError) as raised:
            ranks.result()

    message = str(raised.value)
    assert "training failed: torchrun exited" in message
    assert str(tmp_path / "run" / "torchrun.log") in message
    assert "SIGKILL" in message  # torchrun's summary: the rank lost, and how
    assert not (tmp_path / "run" / RESULT).exists()
    assert not (tmp_path / "adapter").exists()
    left = [pid for pid in [ranks.process.pid, *pids.values()] if running(pid)]
    assert not left, f"processes {left} outlived the failed step"


def rank_pids(run_dir: Path) -> dict[int, int]:
    """Each rank's process id (its RANK), of the launch in `run_dir`: the ranks' command line
    is `python -u -m mint_core.distributed RUN_DIR` (torchrun's ends the same)."""
    pids = {}
    for process in Path("/proc").iterdir():
        try:
            argv = (process / "cmdline").read_bytes().split(b"\0")
            environ = (process / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue  # not a process, or one that has ended
        if str(run_dir).encode() in argv and b"torch.distributed.run" not in argv:
            ranks = [e.removeprefix(b"RANK=") for e in environ if e.startswith(b"RANK=")]
            if b"mint_core.distributed" in argv and ranks:
                pids[int(ranks[0])] = int(process.name)
    return pids


def running(pid: int, grace_s: float = 5.0) -> bool:
    """Whether `pid` is still a live process after `grace_s` (a zombie has ended)."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except FileNotFoundError:
            return False
        if state in ("Z", "X"):
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.1)


HELD: list[object] = []


def hold_the_group(marker: str, rank: Rank) -> str:
    """A rank's job that keeps its process group referenced past the job, as FSDP2's device
    mesh does (its gloo threads then outlive destroy_process_group: measured in the sharded
    base's ranks), and asks for work at interpreter teardown."""
    HELD.append(dist.group.WORLD)
    atexit.register(Path(f"{marker}.{rank.rank}").write_text, "torn down")
    return "done"


def test_a_rank_ends_without_the_interpreters_teardown(tmp_path: Path) -> None:
    """A rank whose job succeeded ends with status 0 at once, its teardown skipped: gloo
    threads racing that teardown crashed such ranks now and then (CI: SIGABRT "terminate
    called without an active exception" in the rl ranks, SIGBUS in the sharded base's)."""
    marker = tmp_path / "teardown"
    job = (f"{__name__}:hold_the_group", str(marker))
    with start_ranks(TWO, tmp_path / "run", ("127.0.0.1", free_port()), job=job) as ranks:
        assert ranks.result() == "done"
        assert ranks.process.wait(timeout=60) == 0
    assert not list(tmp_path.glob("teardown.*"))
