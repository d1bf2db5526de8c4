"""torchrun, started for one node of a training launch, and what its rank 0 says back.

MinT launches on torch.distributed's own launcher rather than a launcher of its own: torchrun
does the rendezvous (static: node 0 is the launching host, so rank 0 runs beside its driver),
starts a process per rank, watches them and ends every one if any fails (`--max-restarts 0`: a
lost rank fails the step; a rerun is the recovery). The driver talks to rank 0 through files in
the run's folder (`mint_core.distributed`), which keeps this side free of torch.
"""

import contextlib
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from mint_core.distributed import (
    COMMAND,
    EVENTS,
    FAILURE,
    HOST_ENV,
    JOB,
    POLL_S,
    REPLY,
    RESULT,
    TIMEOUT_ENV,
    Launch,
    write_atomic,
)
from mint_core.errors import ConfigurationError, DatasetError, MintError, TrainingFailedError
from processes.managed import term_with_parent

RAISED_AGAIN: dict[str, type[MintError]] = {
    cls.__name__: cls for cls in (ConfigurationError, DatasetError, TrainingFailedError)
}
"""MinT errors a rank raises that the driver raises as themselves: a bad setting found on a
rank is the user's to fix, not a failed launch."""
SHOWN_LINES = 40
"""torchrun's last lines in a failure: its summary names the failed rank and its traceback."""
STOP_GRACE_S = 10.0


class Ranks:
    """torchrun for this node, running; rank 0's events, answers and result, as they come."""

    def __init__(self, process: subprocess.Popen[bytes], run_dir: Path, log: Path) -> None:
        self.process = process
        self.run_dir = run_dir
        self.log = log
        self._read = 0
        self._calls = 0

    def events(self) -> list[dict[str, object]]:
        """Rank 0's events written since the last call."""
        path = self.run_dir / EVENTS
        if not path.exists():
            return []
        with path.open() as events:
            events.seek(self._read)
            text = events.read()
        complete = text[: text.rfind("\n") + 1]  # a line still being written waits
        self._read += len(complete.encode())
        return [json.loads(line) for line in complete.splitlines()]

    def result(self, on_event: Callable[[dict[str, object]], None] | None = None) -> object:
        """What the job returned on rank 0, once every rank is done; each event to `on_event`
        on the way. Rank 0's MinT error is raised again; any other failure of any rank (on
        any node of the launch) is a TrainingFailedError that shows torchrun's summary."""
        while True:
            for event in self.events():
                if on_event is not None:
                    on_event(event)
            code = self.process.poll()
            if code is not None:
                for event in self.events():
                    if on_event is not None:
                        on_event(event)
                if code != 0:
                    raise self._failure(code)
                # Only the node of global rank 0 has a result; the others' ranks just end.
                result = self.run_dir / RESULT
                return pickle.loads(result.read_bytes()) if result.exists() else None
            time.sleep(POLL_S * 5)

    def call(self, request: object) -> object:
        """Send a long-lived job (the rl flow's policy update) a request; rank 0's answer."""
        index, self._calls = self._calls, self._calls + 1
        write_atomic(self.run_dir / COMMAND.format(index), pickle.dumps(request))
        reply = self.run_dir / REPLY.format(index)
        while not reply.exists():
            if (code := self.process.poll()) is not None:
                raise self._failure(code)
            time.sleep(POLL_S)
        return pickle.loads(reply.read_bytes())

    def stop(self) -> None:
        """End every rank of this node (SIGTERM to torchrun's group, then SIGKILL)."""
        if self.process.poll() is None:
            _signal_group(self.process, signal.SIGTERM)
            try:
                self.process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_group(self.process, signal.SIGKILL)
                self.process.wait()

    def _failure(self, code: int) -> MintError:
        failure = self.run_dir / FAILURE
        if failure.exists():
            raised = json.loads(failure.read_text())
            if cls := RAISED_AGAIN.get(raised["type"]):
                return cls(raised["message"])
            return TrainingFailedError(raised["message"])
        tail = self.log.read_text(errors="replace").splitlines()[-SHOWN_LINES:]
        said = "".join(f"\n  {line}" for line in self._last_words())
        return TrainingFailedError(
            f"training failed: torchrun exited {code} (a rank failed or was lost; every rank "
            f"was stopped and nothing was kept). This host's ranks last said:{said or ' -'}\n"
            f"torchrun's log {self.log} ends:\n" + "\n".join(tail)
        )

    def _last_words(self) -> list[str]:
        """Each of this node's ranks' last words, by local rank: its error output's last line
        (an exception's message, such as gloo's "Connection reset by peer" where a peer was
        lost), or for a rank that crashed (Python's "Fatal Python error" report) the lines
        that say why: the C++ exception before the report and the report's innermost frame."""
        words = []
        for path in sorted((self.run_dir / "ranks").glob("*/attempt_*/*/stderr.log")):
            lines = [line.strip() for line in path.read_text(errors="replace").splitlines()]
            said = _crash_report(lines) or [next((line for line in reversed(lines) if line), "")]
            words += [f"local rank {path.parent.name}: {line}" for line in said if line]
        return words

    def __enter__(self) -> "Ranks":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _crash_report(lines: list[str]) -> list[str]:
    """From a rank's error output, the lines of its last crash that say why: Python's
    "Fatal Python error: ..." (SIGABRT, SIGSEGV), up to two lines before it (a C++
    exception's `terminate called ...` and `what(): ...`, as gloo's) and the first frame
    of the crashing thread (the innermost call). Empty if it did not crash."""
    fatal = [i for i, line in enumerate(lines) if line.startswith("Fatal Python error:")]
    if not fatal:
        return []
    at = fatal[-1]
    before = [line for line in lines[max(0, at - 2) : at] if line]
    report = lines[at + 1 :]
    current = next((i for i, line in enumerate(report) if line.startswith("Current thread")), 0)
    frame = next((line for line in report[current:] if line.startswith("File ")), "")
    return [*before, lines[at], frame]


def torchrun_argv(
    launch: Launch, run_dir: Path, node_rank: int, master: tuple[str, int]
) -> list[str]:
    """torchrun's command line for node `node_rank` of `launch` (static rendezvous at
    `master`, node 0's address and port)."""
    address, port = master
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(launch.nnodes),
        "--node-rank", str(node_rank),
        "--nproc-per-node", str(launch.nproc_per_node),
        "--master-addr", address,
        "--master-port", str(port),
        "--rdzv-conf", f"timeout={int(launch.timeout_s)}",
        "--max-restarts", "0",
        "--monitor-interval", "0.5",
        "--log-dir", str(run_dir / "ranks"),
        "--redirects", "3",  # each rank's output to its own file: rank 0 speaks through events
        "-m", "mint_core.distributed", str(run_dir),
    ]  # fmt: skip


def start_ranks(
    launch: Launch,
    run_dir: Path,
    master: tuple[str, int],
    *,
    node_rank: int = 0,
    job: tuple[str, object] | None = None,
    env: Mapping[str, str] | None = None,
) -> Ranks:
    """torchrun for node `node_rank` of `launch`, started. Node 0 is given the `job`
    (`module:function`, payload) its rank 0 broadcasts; the others get it from there."""
    if (node_rank == 0) != (job is not None):
        raise ValueError("node 0, and only node 0, is given the job")
    run_dir.mkdir(parents=True, exist_ok=True)
    if job is not None:
        write_atomic(run_dir / JOB, pickle.dumps(job))
    log = run_dir / "torchrun.log"
    variables = {**os.environ, TIMEOUT_ENV: str(launch.timeout_s), **(env or {})}
    variables.setdefault(HOST_ENV, os.uname().nodename)
    # torchrun gives each rank 1 thread when a node runs several, whatever its cores: give each
    # its share of the cores instead (one process keeps torch's own choice).
    if launch.nproc_per_node > 1:
        cores = len(os.sched_getaffinity(0))
        variables.setdefault("OMP_NUM_THREADS", str(max(1, cores // launch.nproc_per_node)))
    with log.open("ab") as out:
        process = subprocess.Popen(
            # Ended with its driver even when that is SIGKILLed (a train host's flow run):
            # ranks never outlive the run that launched them.
            term_with_parent(torchrun_argv(launch, run_dir, node_rank, master)),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=variables,
            start_new_session=True,  # its own group: stop() ends torchrun and every rank
        )
    return Ranks(process, run_dir, log)


def _signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)
