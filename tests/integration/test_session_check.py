"""The session-end check (tests/process_leaks.py): a run that leaves a process behind fails,
names it and kills it; a run that stops what it starts, or leaves only a zombie, passes."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

INNER_TESTS = """
import subprocess
from pathlib import Path


def test_stops_what_it_starts():
    sleeper = subprocess.Popen(["sleep", "300"], start_new_session=True)
    sleeper.kill()
    sleeper.wait()


def test_leaves_a_zombie():
    subprocess.Popen(["true"])  # never waited for: it stays a zombie of this run


def test_leaves_a_grandchild_in_its_own_session():
    # The parent exits at once and the sleep lives on, as uvicorn does when only the
    # `mlflow server` that forked it is killed.
    subprocess.run(
        ["bash", "-c", "setsid sleep 301 >/dev/null 2>&1 & echo $! > {pid_file}"],
        check=True,
    )
"""


def run_inner(tmp_path: Path, selection: str) -> subprocess.CompletedProcess[str]:
    """pytest in a child process, with only the check loaded, on the tests above."""
    pid_file = tmp_path / "sleep.pid"
    (tmp_path / "test_inner.py").write_text(INNER_TESTS.replace("{pid_file}", str(pid_file)))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.process_leaks", "-p", "no:cacheprovider",
         "-k", selection, str(tmp_path / "test_inner.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip


def running(pid: int) -> bool:
    """Whether `pid` runs (a zombie has exited: where PID 1 does not reap, it stays one)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_the_suite_runs_the_check(request: pytest.FixtureRequest) -> None:
    assert request.config.pluginmanager.has_plugin("tests.process_leaks")


def test_a_run_that_leaves_a_process_fails_naming_it_and_the_process_is_killed(
    tmp_path: Path,
) -> None:
    inner = run_inner(tmp_path, "grandchild")
    output = inner.stdout + inner.stderr
    pid = int((tmp_path / "sleep.pid").read_text())
    try:
        assert "1 passed" in output, output
        assert inner.returncode == pytest.ExitCode.TESTS_FAILED, output
        assert "1 process(es) started by the tests outlived them" in output
        assert f"pid {pid}: sleep 301" in output
        deadline = time.monotonic() + 10
        while running(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not running(pid)
    finally:
        if running(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_run_that_stops_what_it_starts_or_leaves_a_zombie_passes(tmp_path: Path) -> None:
    inner = run_inner(tmp_path, "stops or zombie")
    output = inner.stdout + inner.stderr
    assert inner.returncode == pytest.ExitCode.OK, output
    assert "2 passed" in output
    assert "outlived" not in output


STOPPED_TESTS = """
import os
import time
from pathlib import Path

import pytest

from control.services import start_s3


@pytest.fixture
def s3(tmp_path):
    server = start_s3(tmp_path)
    yield server
    server.stop()


def test_runs_until_stopped(s3):
    Path(os.environ["STARTED_FILE"]).write_text(str(s3.process.pid))
    time.sleep(600)
"""


PYTEST_AS_AT_A_TERMINAL = [
    sys.executable,
    "-c",
    "import signal, sys, pytest; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.exit(pytest.main(sys.argv[1:]))",
]
"""pytest with Ctrl-C (SIGINT) handled as Python handles it at a terminal, whatever this run
inherited: a run started in the background by a shell without job control (`(make test &)`)
inherits SIGINT ignored, Python then installs no handler for it, and neither would the inner
run, which would sleep on through the signal."""


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_a_run_stopped_midway_leaves_no_fixture_service_running(
    tmp_path: Path, stop: signal.Signals
) -> None:
    """pytest in a child process, stopped while a test runs over a fixture's S3 server
    (MinT's own `start_s3`): Ctrl-C, a SIGTERM (its fixtures are torn down) or a SIGKILL (the
    run's watchdog stops what it left)."""
    started = tmp_path / "started"
    (tmp_path / "test_stopped.py").write_text(STOPPED_TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    inner = subprocess.Popen(
        [*PYTEST_AS_AT_A_TERMINAL, "-p", "tests.process_leaks", "-p", "no:cacheprovider",
         str(tmp_path / "test_stopped.py")],
        cwd=ROOT,
        env={**os.environ, "STARTED_FILE": str(started)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    service = None
    try:
        deadline = time.monotonic() + 300
        while not (started.exists() and started.read_text()):
            assert inner.poll() is None, inner.communicate()[0].decode()[-3000:]
            assert time.monotonic() < deadline, "the inner test never started"
            time.sleep(0.1)
        service = int(started.read_text())
        assert running(service)

        inner.send_signal(stop)
        output = inner.communicate(timeout=120)[0].decode()
        deadline = time.monotonic() + 30
        while running(service) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not running(service), output[-3000:]
        if stop is not signal.SIGKILL:  # torn down as any run ends: nothing left to kill
            assert "outlived" not in output, output[-3000:]
    finally:
        inner.kill()
        inner.wait()
        if service is not None and running(service):
            os.killpg(service, signal.SIGKILL)
