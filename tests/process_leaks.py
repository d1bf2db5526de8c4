"""A pytest plugin that fails the run if a process the tests started outlives it.

At configure time the run puts a mark of its own in its environment; every process started
from it inherits the mark, grandchildren too, even in sessions and process groups of their own
(`mlflow server` forks uvicorn; a worker may fork). Once every fixture is torn down, any live
process still carrying the mark was left behind: it is listed, killed, and the run fails.

    pytest -p tests.process_leaks ...   (the suite's conftest loads it by itself)

A run that is stopped stops what it started too: SIGTERM and SIGHUP interrupt it as Ctrl-C
(SIGINT) does, so fixtures are torn down; and a watchdog process, started in a session of its
own before the first test that may start a process, kills whatever still carries the run's
mark once the run has exited, however it ended (SIGKILL included), then removes what is left
of the test clusters whose run died (network namespaces are not processes: tests/cluster/netns.py).

A test that uses the `refuse_processes` fixture (every test in tests/unit does) fails if it
starts a process of any kind; a run of such tests alone starts no watchdog either, so it
starts no process at all.

Under pytest-xdist each worker process checks its own tests' processes at its end and hands
what it found to the controller (`workeroutput`), which lists them, and fails the run, with
its own.

Linux only (it reads /proc); elsewhere it says that it did not check.
"""

import _posixsubprocess
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Generator
from contextlib import suppress
from pathlib import Path
from typing import Any, NoReturn

import pytest

MARKS_VARIABLE = "PYTEST_MINT_SESSIONS"
"""Space-separated marks of the test runs a process descends from (a run may start another).
Not MINT_-prefixed: tests start `mint` commands with MinT's own variables removed."""

EXIT_GRACE_S = 2.0
"""How long a process found at the end may take to exit by itself: one killed a moment ago is
on its way out, not left behind."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""Signals that stop a run the way Ctrl-C does (pytest's default for them is to die at once,
tearing nothing down)."""
WATCH_INTERVAL_S = 0.2
KILL_GRACE_S = 5.0
"""How long the watchdog gives what it stops to exit on SIGTERM before SIGKILL."""
EXEC_WAIT_S = 1.0
"""How long a process whose environment reads empty while it runs may take to finish an exec
(see `environ_of`)."""
PF_KTHREAD = 0x00200000
"""The kernel thread flag in /proc/PID/stat: a kernel thread has no environment at all."""

SPAWNS: tuple[tuple[object, str], ...] = (
    (subprocess.Popen, "_execute_child"),  # subprocess.run and friends, asyncio's subprocesses
    (_posixsubprocess, "fork_exec"),  # multiprocessing's spawn and forkserver
    (os, "fork"),  # multiprocessing's fork, and anyone's
    (os, "forkpty"),
    (os, "posix_spawn"),
    (os, "posix_spawnp"),
    (os, "system"),
)
"""Every way a Python process starts another: what `refuse_processes` makes fail."""

_PROC = Path("/proc")
CLUSTER_RECORDS = Path("/run/mint-cluster")
"""Where tests/cluster/netns.py records the clusters it makes (RECORDS there)."""
_mark = pytest.StashKey[str]()
_ancestors = pytest.StashKey[str]()
_handlers = pytest.StashKey[dict[int, object]]()
_watchdog = pytest.StashKey["subprocess.Popen[bytes]"]()
_left_by_workers = pytest.StashKey[dict[int, str]]()
WORKER_OUTPUT = "processes_left_running"
"""The key an xdist worker hands its leftovers to the controller under."""


def pytest_configure(config: pytest.Config) -> None:
    mark = uuid.uuid4().hex
    config.stash[_mark] = mark
    ancestors = os.environ.get(MARKS_VARIABLE, "")
    config.stash[_ancestors] = ancestors
    os.environ[MARKS_VARIABLE] = f"{ancestors} {mark}".strip()
    if threading.current_thread() is threading.main_thread():  # else signals cannot be set
        config.stash[_handlers] = {sig: signal.signal(sig, _interrupt) for sig in STOP_SIGNALS}


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures, which may start processes
def pytest_runtest_setup(item: pytest.Item) -> None:
    config = item.config
    if _watchdog in config.stash or "refuse_processes" in item.fixturenames:
        return
    if _PROC.is_dir():  # it outlives the run by design
        config.stash[_watchdog] = start_watchdog(config.stash[_mark], config.stash[_ancestors])


@pytest.fixture
def refuse_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting a process fails the test (an AssertionError naming the call): a test that
    needs a server, a worker, a `mint` command or any subprocess is an integration test."""
    for owner, name in SPAWNS:

        def refuse(*args: object, _name: str = name, **kwargs: object) -> NoReturn:
            raise AssertionError(
                f"a test that refuses processes started one ({_name}); one that needs a process "
                "belongs in tests/integration"
            )

        monkeypatch.setattr(owner, name, refuse)


def pytest_unconfigure(config: pytest.Config) -> None:
    for sig, handler in config.stash.get(_handlers, {}).items():
        signal.signal(sig, handler)  # type: ignore[arg-type]


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


def start_watchdog(mark: str, ancestors: str) -> subprocess.Popen[bytes]:
    """A process that waits for this one to exit, then stops every process carrying `mark`.
    It carries only the `ancestors`' marks itself (so the run's own check does not count it),
    and runs in a session of its own (so the Ctrl-C that stops the run does not stop it)."""
    return subprocess.Popen(
        [sys.executable, "-m", "tests.process_leaks", str(os.getpid()), mark],
        cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, MARKS_VARIABLE: ancestors},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def watch(parent: int, mark: str) -> None:
    """Wait for `parent` (the run) to exit, then stop what carries `mark`: SIGTERM, and
    SIGKILL to what still runs after KILL_GRACE_S."""
    while os.getppid() == parent:
        time.sleep(WATCH_INTERVAL_S)
    for sig, grace_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 0.0)):
        for pid in carrying(mark):
            with suppress(ProcessLookupError):
                os.kill(pid, sig)
        if not left_running(mark, grace_s):
            return


@pytest.hookimpl(wrapper=True)
def pytest_sessionfinish(session: pytest.Session) -> Generator[None]:
    # After the yield every other sessionfinish has run, pytest's own fixture teardown included.
    try:
        return (yield)
    finally:
        fail_on_leftovers(session)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's controller: a worker process ended
def pytest_testnodedown(node: Any, error: object) -> None:
    left = getattr(node, "workeroutput", {}).get(WORKER_OUTPUT, {})
    node.config.stash.setdefault(_left_by_workers, {}).update(
        {int(pid): command for pid, command in left.items()}
    )


def fail_on_leftovers(session: pytest.Session) -> None:
    """List and kill the processes this run left running, and make the run fail (an xdist
    worker hands them to the controller, which does the listing and failing)."""
    config = session.config
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if not _PROC.is_dir():
        if reporter is not None:
            reporter.write_line("no /proc: processes left running were not checked", yellow=True)
        return
    left = left_running(config.stash[_mark], EXIT_GRACE_S)
    for pid in left:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if (workeroutput := getattr(config, "workeroutput", None)) is not None:
        workeroutput[WORKER_OUTPUT] = {str(pid): command for pid, command in left.items()}
        return
    left |= config.stash.get(_left_by_workers, {})
    if not left:
        return
    if reporter is not None:
        reporter.write_sep(
            "=", f"{len(left)} process(es) started by the tests outlived them", red=True
        )
        for pid, command in sorted(left.items()):
            reporter.write_line(f"pid {pid}: {command}")
        reporter.write_line("killed them; a fixture or test must stop what it starts (all of its")
        reporter.write_line("process group: see processes.ManagedProcess.stop)")
    if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def left_running(mark: str, grace_s: float) -> dict[int, str]:
    """pid -> command line of each live process (this one aside) that carries `mark`, once
    those that exit within `grace_s` have done so."""
    deadline = time.monotonic() + grace_s
    while (found := carrying(mark)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def carrying(mark: str) -> dict[int, str]:
    """pid -> command line of each live process (this one aside) whose environment carries
    `mark`. A zombie has exited and shows no environment, so it is never counted."""
    found = {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = environ_of(entry)
            command = (entry / "cmdline").read_bytes()
        except OSError:  # exited while we looked, or another user's
            continue
        if mark in marks_in(environ):
            found[int(entry.name)] = command.replace(b"\0", b" ").decode(errors="replace").strip()
    return found


def environ_of(process: Path) -> bytes:
    """The environment of the process at /proc/PID. Read while the process execs, it comes
    back empty (the old memory is gone, the new one not set up yet): a grandchild that a test
    left mid-exec (`bash -c "setsid sleep 300 &"` under load) would not be counted. So an
    empty read of a live process that is not a kernel thread is read again until the exec is
    done."""
    deadline = time.monotonic() + EXEC_WAIT_S
    while not (environ := (process / "environ").read_bytes()) and time.monotonic() < deadline:
        state, flags = _state_and_flags(process)
        if state in ("Z", "X") or flags & PF_KTHREAD:
            break
        time.sleep(0.01)
    return environ


def _state_and_flags(process: Path) -> tuple[str, int]:
    fields = (process / "stat").read_text().rpartition(")")[2].split()
    return fields[0], int(fields[6])


def marks_in(environ: bytes) -> list[str]:
    prefix = f"{MARKS_VARIABLE}=".encode()
    for entry in environ.split(b"\0"):
        if entry.startswith(prefix):
            return entry.removeprefix(prefix).decode(errors="replace").split()
    return []


def sweep_clusters() -> None:
    """Remove the namespaces and links of test clusters whose run died; only where a cluster
    was ever made (its records' folder exists), so other runs import nothing more."""
    if CLUSTER_RECORDS.is_dir():
        from tests.cluster.netns import sweep

        sweep()


if __name__ == "__main__":
    watch(int(sys.argv[1]), sys.argv[2])
    sweep_clusters()
