"""A pytest plugin that fails the run if a process the tests started outlives it.

At configure time the run puts a mark of its own in its environment; every process started
from it inherits the mark, grandchildren too, even in sessions and process groups of their own
(`mlflow server` forks uvicorn; a worker may fork). Once every fixture is torn down, any live
process still carrying the mark was left behind: it is listed, killed, and the run fails.

    pytest -p tests.process_leaks ...   (the suite's conftest loads it by itself)

Linux only (it reads /proc); elsewhere it says that it did not check.
"""

import os
import signal
import time
import uuid
from collections.abc import Generator
from contextlib import suppress
from pathlib import Path

import pytest

MARKS_VARIABLE = "PYTEST_MINT_SESSIONS"
"""Space-separated marks of the test runs a process descends from (a run may start another).
Not MINT_-prefixed: tests start `mint` commands with MinT's own variables removed."""

EXIT_GRACE_S = 2.0
"""How long a process found at the end may take to exit by itself: one killed a moment ago is
on its way out, not left behind."""

_PROC = Path("/proc")
_mark = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    mark = uuid.uuid4().hex
    config.stash[_mark] = mark
    os.environ[MARKS_VARIABLE] = f"{os.environ.get(MARKS_VARIABLE, '')} {mark}".strip()


@pytest.hookimpl(wrapper=True)
def pytest_sessionfinish(session: pytest.Session) -> Generator[None]:
    # After the yield every other sessionfinish has run, pytest's own fixture teardown included.
    try:
        return (yield)
    finally:
        fail_on_leftovers(session)


def fail_on_leftovers(session: pytest.Session) -> None:
    """List and kill the processes this run left running, and make the run fail."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if not _PROC.is_dir():
        if reporter is not None:
            reporter.write_line("no /proc: processes left running were not checked", yellow=True)
        return
    left = left_running(session.config.stash[_mark], EXIT_GRACE_S)
    if not left:
        return
    for pid in left:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if reporter is not None:
        reporter.write_sep(
            "=", f"{len(left)} process(es) started by the tests outlived them", red=True
        )
        for pid, command in sorted(left.items()):
            reporter.write_line(f"pid {pid}: {command}")
        reporter.write_line("killed them; a fixture or test must stop what it starts (all of its")
        reporter.write_line("process group: see mint_core.services.ManagedProcess.stop)")
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
            environ = (entry / "environ").read_bytes()
            command = (entry / "cmdline").read_bytes()
        except OSError:  # exited while we looked, or another user's
            continue
        if mark in marks_in(environ):
            found[int(entry.name)] = command.replace(b"\0", b" ").decode(errors="replace").strip()
    return found


def marks_in(environ: bytes) -> list[str]:
    prefix = f"{MARKS_VARIABLE}=".encode()
    for entry in environ.split(b"\0"):
        if entry.startswith(prefix):
            return entry.removeprefix(prefix).decode(errors="replace").split()
    return []
