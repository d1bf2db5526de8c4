"""A distributed launch's options and the driver's side of torchrun, without a process: bad
options are refused naming the value, torchrun's command line is the static rendezvous MinT
relies on (no restarts), and what rank 0 writes to the run folder is read whole (a half-written
event waits; a MinT error comes back as itself, any other failure as TrainingFailedError).
Running ranks for real is tests/integration/test_distributed_training.py."""

import json
import math
import pickle
import sys
from pathlib import Path

import pytest

from mint_core.distributed import (
    EVENTS,
    FAILURE,
    ONE_PROCESS,
    RESULT,
    Launch,
    check_shares,
    endpoint_parts,
)
from mint_core.errors import ConfigurationError, DatasetError, TrainingFailedError
from processes.torchrun import Ranks, torchrun_argv


class Exited:
    """Stands in for torchrun's Popen once it has exited with `code` (no process started)."""

    def __init__(self, code: int | None) -> None:
        self.code = code

    def poll(self) -> int | None:
        return self.code


def ranks_in(run_dir: Path, code: int | None = 0, log: str = "") -> Ranks:
    (run_dir / "torchrun.log").write_text(log)
    return Ranks(Exited(code), run_dir, run_dir / "torchrun.log")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"nproc_per_node": 0}, "nproc_per_node=0"),
        ({"nproc_per_node": -2}, "nproc_per_node=-2"),
        ({"nnodes": 0}, "nnodes=0"),
        ({"timeout_s": 0}, "timeout_s=0"),
        ({"timeout_s": -5.0}, "timeout_s=-5.0"),
        ({"timeout_s": math.nan}, "timeout_s=nan"),
        ({"rdzv_endpoint": "10.0.0.5:port"}, "'10.0.0.5:port'"),
        ({"rdzv_endpoint": ":29500"}, "':29500'"),
        ({"rdzv_endpoint": "10.0.0.5:0"}, "'10.0.0.5:0'"),
        ({"rdzv_endpoint": "10.0.0.5:65536"}, "'10.0.0.5:65536'"),
    ],
)
def test_bad_launch_options_are_refused_naming_the_value(
    options: dict[str, object], named: str
) -> None:
    with pytest.raises(ConfigurationError, match=named.replace(".", r"\.")):
        Launch(**options)  # type: ignore[arg-type]


def test_an_endpoint_is_a_host_and_an_optional_port() -> None:
    assert endpoint_parts("10.0.0.5:29500") == ("10.0.0.5", 29500)
    assert endpoint_parts("train-1") == ("train-1", 0)
    assert endpoint_parts("train-1", default_port=29500) == ("train-1", 29500)
    assert endpoint_parts("train-1:1") == ("train-1", 1)
    with pytest.raises(ConfigurationError, match=r"'train-1:x' is not HOST\[:PORT\]"):
        endpoint_parts("train-1:x")


def test_the_world_is_every_process_on_every_node() -> None:
    assert Launch() == ONE_PROCESS and Launch().world_size == 1 and Launch().in_process
    assert Launch(nproc_per_node=2, nnodes=3).world_size == 6
    assert not Launch(nproc_per_node=2).in_process
    assert not Launch(nnodes=2).in_process
    # One process with its base sharded still runs as a rank (FSDP2 needs a process group).
    assert not Launch(shard_base=True).in_process
    assert Launch(nproc_per_node=2, nnodes=2, rdzv_endpoint="10.0.0.5:29500").params() == {
        "world_size": "4",
        "nproc_per_node": "2",
        "nnodes": "2",
        "rdzv_endpoint": "10.0.0.5:29500",
        "timeout_s": "300.0",
        "shard_base": "False",
    }


def test_torchrun_runs_a_static_rendezvous_without_restarts(tmp_path: Path) -> None:
    launch = Launch(nproc_per_node=2, nnodes=3, timeout_s=90)
    argv = torchrun_argv(launch, tmp_path / "run", 1, ("10.0.0.5", 29511))
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    options = dict(zip(argv[3:-3:2], argv[4:-3:2], strict=True))
    assert options["--nnodes"] == "3"
    assert options["--node-rank"] == "1"
    assert options["--nproc-per-node"] == "2"
    # Static rendezvous: node 0's address and port, no rendezvous backend or elastic range.
    assert options["--master-addr"] == "10.0.0.5"
    assert options["--master-port"] == "29511"
    assert "--rdzv-backend" not in options and "--rdzv-endpoint" not in options
    assert options["--rdzv-conf"] == "timeout=90"
    # A lost rank fails the step: torchrun never restarts the group.
    assert options["--max-restarts"] == "0"
    assert options["--log-dir"] == str(tmp_path / "run" / "ranks")
    assert argv[-3:] == ["-m", "mint_core.distributed", str(tmp_path / "run")]


def test_events_are_read_once_each_and_a_half_written_line_waits(tmp_path: Path) -> None:
    ranks = ranks_in(tmp_path, code=None)
    assert ranks.events() == []  # rank 0 has written nothing yet
    path = tmp_path / EVENTS
    first = {"started": {"rank": 8}}
    # Not ASCII: the offset read up to is in bytes, not characters.
    second = {"step": 1, "total": 3, "loss": 2.5, "note": "é→ü"}
    half = json.dumps({"step": 2, "total": 3, "loss": 2.25})
    path.write_text(json.dumps(first) + "\n" + json.dumps(second) + "\n" + half[:11])
    assert ranks.events() == [first, second]
    assert ranks.events() == []  # the half line is not an event yet
    with path.open("a") as events:
        events.write(half[11:] + "\n" + json.dumps({"step": 3}) + "\n")
    assert ranks.events() == [json.loads(half), {"step": 3}]
    assert ranks.events() == []


def test_the_result_is_rank_0s_after_every_event(tmp_path: Path) -> None:
    (tmp_path / EVENTS).write_text('{"step": 1}\n{"step": 2}\n')
    (tmp_path / RESULT).write_bytes(pickle.dumps({"adapter": "done"}))
    seen: list[dict[str, object]] = []
    assert ranks_in(tmp_path).result(seen.append) == {"adapter": "done"}
    assert seen == [{"step": 1}, {"step": 2}]
    # A node other than node 0 has no result: its ranks just end.
    (tmp_path / RESULT).unlink()
    assert ranks_in(tmp_path).result() is None


@pytest.mark.parametrize("error", [ConfigurationError, DatasetError])
def test_a_users_error_on_rank_0_is_raised_as_itself(
    tmp_path: Path, error: type[Exception]
) -> None:
    failure = {"type": error.__name__, "message": "batch_size=1 is smaller than 2"}
    (tmp_path / FAILURE).write_text(json.dumps(failure))
    with pytest.raises(error, match="batch_size=1 is smaller than 2") as raised:
        ranks_in(tmp_path, code=1).result()
    assert not isinstance(raised.value, TrainingFailedError)


def test_any_other_failure_is_a_failed_step_showing_torchruns_log(tmp_path: Path) -> None:
    log = "".join(f"line {n}\n" for n in range(100)) + "  rank : 1 (local_rank: 1)\n"
    with pytest.raises(TrainingFailedError) as raised:
        ranks_in(tmp_path, code=1, log=log).result()
    message = str(raised.value)
    assert "torchrun exited 1" in message and str(tmp_path / "torchrun.log") in message
    assert message.endswith("rank : 1 (local_rank: 1)")  # the summary naming the lost rank
    assert "line 99" in message and "line 10\n" not in message  # the log's tail only
    # Each rank's last words lead: the reason, before torchrun's summary of it.
    stderr = tmp_path / "ranks" / "run_x" / "attempt_0" / "0" / "stderr.log"
    stderr.parent.mkdir(parents=True)
    stderr.write_text("Traceback ...\nRuntimeError: Connection reset by peer\n\n")
    with pytest.raises(TrainingFailedError) as raised:
        ranks_in(tmp_path, code=1, log=log).result()
    assert "last said:\n  local rank 0: RuntimeError: Connection reset by peer\n" in str(
        raised.value
    )
    # A rank that crashed: the lines that say why, not the report's list of C modules.
    stderr.write_text(CRASHED)
    with pytest.raises(TrainingFailedError) as raised:
        ranks_in(tmp_path, code=1, log=log).result()
    said = str(raised.value).split("last said:\n")[1].split("\ntorchrun's log")[0]
    assert said.splitlines() == [
        "  local rank 0: terminate called after throwing an instance of 'gloo::IoException'",
        "  local rank 0: what():  [pair.cc:589] Read error [127.0.0.1]:3977: Connection reset"
        " by peer",
        "  local rank 0: Fatal Python error: Aborted",
        '  local rank 0: File "/mint/mint_core/distributed.py", line 241 in main',
    ]
    # A MinT error other than the user's (e.g. one MinT does not raise again) is a failed step.
    (tmp_path / FAILURE).write_text(json.dumps({"type": "ServiceError", "message": "gone"}))
    with pytest.raises(TrainingFailedError, match=r"^gone$"):
        ranks_in(tmp_path, code=1).result()


CRASHED = """\
step 3
terminate called after throwing an instance of 'gloo::IoException'
  what():  [pair.cc:589] Read error [127.0.0.1]:3977: Connection reset by peer
Fatal Python error: Aborted

Thread 0x00007f1c534b9700 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait

Current thread 0x00007f272c1beb80 (most recent call first):
  File "/mint/mint_core/distributed.py", line 241 in main
  File "<frozen runpy>", line 88 in _run_code

Extension modules: numpy._core._multiarray_umath, torch._C (total: 2)
"""
"""A rank's stderr after an abort, as Python's faulthandler reports it (its shape: a real
abort's, with a gloo exception written before it, and a second thread)."""


def test_a_batch_smaller_than_the_world_is_refused_before_any_process_starts() -> None:
    check_shares(8, 8)
    with pytest.raises(ConfigurationError, match="batch_size=1 is smaller than the 2"):
        check_shares(1, 2)
