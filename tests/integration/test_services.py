"""Stopping a started service stops its whole process group, whatever its leader did: the
shape of `mlflow server`, whose uvicorn child can outlive it."""

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from mint_core.errors import ServiceError
from processes import ManagedProcess, group_running, start_process, start_together, stop_all


def started(tmp_path: Path, script: str) -> tuple[ManagedProcess, int]:
    """`bash -c script` in a group of its own; the script writes its child's pid to a file,
    and the service counts as healthy once it has."""
    pid_file = tmp_path / "child.pid"
    service = start_process(
        "test service",
        ["bash", "-c", script.replace("PID_FILE", str(pid_file))],
        "http://127.0.0.1:9",
        lambda: pid_file.exists() and pid_file.read_text().strip() != "",
        tmp_path / "service.log",
        timeout_s=30,
    )
    return service, int(pid_file.read_text())


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_a_child_outliving_its_leader_is_stopped(tmp_path: Path) -> None:
    service, child = started(tmp_path, "sleep 300 & echo $! > PID_FILE; wait")
    service.process.kill()  # the leader alone, as `process.kill()` on `mlflow server` does
    service.process.wait()
    assert running(child)

    service.stop()

    assert not running(child)
    assert not group_running(service.process.pid)


def test_a_child_that_ignores_sigterm_is_killed_before_stop_returns(tmp_path: Path) -> None:
    # The leader dies on SIGTERM at once; the child shrugs it off, as a web server waiting for
    # open connections can.
    service, child = started(
        tmp_path, "bash -c 'trap \"\" TERM; echo $$ > PID_FILE; exec sleep 300' & wait"
    )
    started_at = time.monotonic()
    service.stop(grace_s=1.0)
    assert time.monotonic() - started_at >= 1.0
    assert service.process.poll() is not None
    assert not running(child)


def test_a_zombie_left_in_the_group_does_not_hold_stop_up(tmp_path: Path) -> None:
    # `true` exits and `sleep` (exec'd in the leader's place) never reaps it: a zombie stays in
    # the group; where PID 1 does not reap orphans it stays one after the leader is gone.
    service, zombie = started(tmp_path, "true & echo $! > PID_FILE; exec sleep 300")
    started_at = time.monotonic()
    service.stop(grace_s=30.0)
    assert time.monotonic() - started_at < 10.0
    assert service.process.returncode is not None
    assert not running(zombie)


def test_a_service_that_fails_to_start_leaves_nothing_running(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    with pytest.raises(ServiceError, match="exited with code 3 while starting"):
        start_process(
            "failing service",
            ["bash", "-c", f"sleep 300 & echo $! > {pid_file}; exit 3"],
            "http://127.0.0.1:9",
            lambda: False,
            tmp_path / "service.log",
            timeout_s=30,
        )
    assert not running(int(pid_file.read_text()))


def test_services_started_together_are_up_together_in_the_order_asked(tmp_path: Path) -> None:
    # Each takes two seconds to be healthy: together, about two seconds, not four.
    def slow(name: str) -> Callable[[], ManagedProcess]:
        def start() -> ManagedProcess:
            (tmp_path / name).mkdir()
            return started(tmp_path / name, "sleep 2; sleep 300 & echo $! > PID_FILE; wait")[0]

        return start

    started_at = time.monotonic()
    services = start_together([slow("a"), slow("b")])
    took_s = time.monotonic() - started_at
    try:
        assert [service.log_path.parent.name for service in services] == ["a", "b"]
        assert all(service.process.poll() is None for service in services)
        assert took_s < 3.5, f"two two-second starts together took {took_s:.2f} s"
    finally:
        stop_all(services)


def starter(
    folder: Path, name: str, script: str, healthy: Callable[[], bool]
) -> Callable[[], ManagedProcess]:
    """A start for `start_together`: `bash -c script`, healthy once `healthy()`."""
    return lambda: start_process(
        name, ["bash", "-c", script], "http://127.0.0.1:9", healthy, folder / f"{name}.log"
    )


def up_and_waiting(folder: Path) -> tuple[list[Callable[[], ManagedProcess]], list[Path]]:
    """Two starts of a `sleep` child that writes its pid to a file: one healthy once it has,
    one never (without being called off, it would wait the full 120 s); and the pid files."""
    pid_files = [folder / f"{name}.pid" for name in ("up", "waiting")]
    script = "sleep 300 & echo $! > {}; wait"
    up = starter(folder, "up", script.format(pid_files[0]), pid_files[0].exists)
    waiting = starter(folder, "waiting", script.format(pid_files[1]), lambda: False)
    return [up, waiting], pid_files


def both_written(pid_files: list[Path]) -> bool:
    return all(pid_file.exists() and pid_file.read_text().strip() for pid_file in pid_files)


def test_a_failed_start_calls_the_others_off_and_stops_what_started(tmp_path: Path) -> None:
    starts, pid_files = up_and_waiting(tmp_path)
    # It fails once the others' children run, whatever the load: bounded by start_process's
    # own timeout, whose error would fail the match below.
    up, waiting = (shlex.quote(str(pid_file)) for pid_file in pid_files)
    script = f"until [ -s {up} ] && [ -s {waiting} ]; do sleep 0.05; done; exit 3"
    failing = starter(tmp_path, "failing", script, lambda: False)

    started_at = time.monotonic()
    with pytest.raises(ServiceError, match="failing exited with code 3"):
        start_together([*starts, failing])
    assert time.monotonic() - started_at < 30.0
    assert not any(running(int(pid_file.read_text())) for pid_file in pid_files)


def test_an_interrupted_start_together_stops_what_started(tmp_path: Path) -> None:
    # As Ctrl-C does in `mint up`: its handler raises KeyboardInterrupt in the main thread.
    class Interrupted(Exception):
        pass

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    def interrupt_once_both_run() -> None:
        # At most the 30 s the test allows the start; past that it interrupts anyway, and the
        # test fails on what it finds.
        deadline = time.monotonic() + 30.0
        while not both_written(pid_files) and time.monotonic() < deadline and not done.is_set():
            time.sleep(0.05)
        if not done.is_set():  # never once the default SIGUSR1 (exit) is back
            os.kill(os.getpid(), signal.SIGUSR1)

    starts, pid_files = up_and_waiting(tmp_path)
    previous = signal.signal(signal.SIGUSR1, interrupt)
    done = threading.Event()
    interrupter = threading.Thread(target=interrupt_once_both_run)
    interrupter.start()
    started_at = time.monotonic()
    try:
        with pytest.raises(Interrupted):
            start_together(starts)
    finally:
        done.set()
        interrupter.join()
        signal.signal(signal.SIGUSR1, previous)
    assert time.monotonic() - started_at < 30.0
    assert not any(running(int(pid_file.read_text())) for pid_file in pid_files)


def test_vllm_dies_with_a_worker_killed_outright_and_no_preexec_fn_started_it(
    tmp_path: Path,
) -> None:
    """The worker's own start of vLLM (`VllmServer.start`), in a threaded process that refuses
    Popen's `preexec_fn` (Python between fork and exec, unsafe there), of a stand-in vLLM
    that answers `/health`; then the worker is SIGKILLed and vLLM must exit by itself."""
    stand_in = tmp_path / "vllm_stand_in.py"
    stand_in.write_text(STAND_IN_VLLM)
    python = tmp_path / "python"  # what VllmSettings.python names: vLLM's environment
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{stand_in}" "$@"\n')
    python.chmod(0o755)
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER_STARTING_VLLM, str(python), str(tmp_path)],
        cwd=Path(__file__).resolve().parents[2],
        # Where the killed worker leaves its vLLM's sockets folder: the test's own.
        env=os.environ | {"TMPDIR": str(tmp_path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    vllm = None
    try:
        assert worker.stdout is not None and worker.stderr is not None
        line = worker.stdout.readline()
        assert line.strip().isdigit(), worker.stderr.read()[-3000:]
        vllm = int(line)
        assert running(vllm)

        worker.kill()
        worker.wait()
        deadline = time.monotonic() + 30
        while running(vllm) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running(vllm), "vLLM outlived the worker that started it"
    finally:
        worker.kill()
        worker.wait()
        if vllm is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(vllm, signal.SIGKILL)


STAND_IN_VLLM = """
import http.server, sys

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

port = int(sys.argv[sys.argv.index("--port") + 1])
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""

WORKER_STARTING_VLLM = """
import subprocess, sys, threading, time, types
from pathlib import Path

popen = subprocess.Popen.__init__

def without_preexec_fn(self, *args, **kwargs):
    if kwargs.get("preexec_fn") is not None:
        raise RuntimeError("preexec_fn in a threaded program")
    popen(self, *args, **kwargs)

subprocess.Popen.__init__ = without_preexec_fn

from serving.backends.vllm import VllmServer, VllmSettings

for _ in range(4):  # a worker runs many threads
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
home = Path(sys.argv[2])
settings = VllmSettings(
    python=Path(sys.argv[1]), home=home, device_slots=1, host_adapters=1, max_lora_rank=8,
    max_batch=1, dtype="float32", device="cpu",
)
server = VllmServer(settings, types.SimpleNamespace(path=home, model_id="stand-in"))
print(server.start().process.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize(
    ("script", "says"),
    [
        ("exit 3", r"its log \(.*service\.log\) is empty$"),
        ("echo 'no such model'; exit 3", r"its log \(.*service\.log\) ends with:\nno such model$"),
    ],
)
def test_a_failed_start_quotes_its_log_only_when_there_is_something_to_quote(
    tmp_path: Path, script: str, says: str
) -> None:
    with pytest.raises(ServiceError, match=says):
        start_process(
            "quiet service",
            ["bash", "-c", script],
            "http://127.0.0.1:9",
            lambda: False,
            tmp_path / "service.log",
            timeout_s=30,
        )


def test_stop_all_stops_the_services_others_use_after_them(tmp_path: Path) -> None:
    # The user, 0.3 s into its shutdown, notes whether the backing service still runs (as a
    # flow server pausing its deployments needs its Prefect server), then exits.
    backing = tmp_path / "backing"
    backing.mkdir()
    server, server_pid = started(backing, "sleep 300 & echo $! > PID_FILE; wait")
    server.backing = True
    seen = tmp_path / "seen"
    script = (
        f"trap 'sleep 0.3; kill -0 {server_pid} && echo running > {seen}; exit 0' TERM; "
        "sleep 300 & echo $! > PID_FILE; wait"
    )
    user, _ = started(tmp_path, script)
    started_at = time.monotonic()
    stop_all([server, user])  # in the order they started: the backing one first
    assert seen.exists(), "the backing service was stopped before the one that uses it"
    assert not group_running(server.process.pid) and not group_running(user.process.pid)
    assert time.monotonic() - started_at < user.grace_s  # neither waited out its grace
