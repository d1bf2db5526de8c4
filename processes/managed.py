"""Starting and stopping child processes (on loopback unless told otherwise), for whichever
role runs them.

Each process gets its own process group, so stopping it also stops whatever it spawned (MLflow's
server forks a web server), and its output goes to a log file under the state dir.
"""

import base64
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from mint_core.config import LOOPBACK
from mint_core.errors import ServiceError
from mint_core.registry_accounts import RegistryAccounts


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port on `host` (default loopback) that nothing listens on right now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.bind((host.strip("[]"), 0))
        return probe.getsockname()[1]


def basic_auth(secret: str) -> dict[str, str]:
    """The Authorization header Prefect's server checks an auth string with
    (PREFECT_SERVER_API_AUTH_STRING; its clients send PREFECT_API_AUTH_STRING this way), for
    MinT's own probes of it. Empty without a secret."""
    if not secret:
        return {}
    return {"Authorization": "Basic " + base64.b64encode(secret.encode()).decode()}


@dataclass
class ManagedProcess:
    """A started service: its process, base URL and log file."""

    name: str
    process: subprocess.Popen[bytes]
    url: str
    log_path: Path
    grace_s: float = 10.0
    """How long `stop` lets it shut down after SIGTERM before it kills what is left."""
    accounts: RegistryAccounts | None = None
    """For an MLflow server with authentication: who may sign in, and as what."""
    backing: bool = False
    """Whether other services use it (MLflow, Prefect, S3): `stop_all` stops it after them."""

    def stop(self, grace_s: float | None = None) -> None:
        """Stop the process and everything in its process group: SIGTERM, then SIGKILL to
        whatever still runs after `grace_s` (default: its own). Returns once none of them runs,
        even when the leader had already exited: MLflow's uvicorn outlives a `mlflow server`
        that is gone."""
        grace_s = self.grace_s if grace_s is None else grace_s
        group = self.process.pid
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            if not group_running(group):
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, sig)
            deadline = time.monotonic() + wait_s
            while group_running(group) and time.monotonic() < deadline:
                self.process.poll()  # reap the leader as soon as it exits
                time.sleep(0.05)
        self.process.poll()
        if group_running(group):
            raise ServiceError(
                f"{self.name} (process group {group}) still runs after SIGKILL; a process in "
                f"uninterruptible sleep waits on a device or file system: see `ps -g {group}`"
            )

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def log_excerpt(self) -> str:
        """Where its log is and how it ends, for an error message; an empty log is said to be
        empty rather than quoted."""
        tail = self.log_tail().strip()
        if not tail:
            return f"its log ({self.log_path}) is empty"
        return f"its log ({self.log_path}) ends with:\n{tail}"


def group_running(group: int) -> bool:
    """Whether a process of process group `group` runs. Zombies do not count: they have
    exited, and where PID 1 does not reap orphans (some containers) they stay in the group."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    proc = Path("/proc")
    if not proc.is_dir():
        return True  # no /proc to tell zombies apart; init reaps orphans on such systems
    for stat in proc.glob("[0-9]*/stat"):
        try:
            # After the command name in parentheses: state, parent pid, process group.
            state, _, pgrp = stat.read_text().rpartition(")")[2].split()[:3]
        except OSError:  # exited while we looked
            continue
        if int(pgrp) == group and state not in ("Z", "X"):
            return True
    return False


def stop_all(services: Sequence[ManagedProcess]) -> None:
    """Stop several services in two steps, each stopping its services at once (each gets its
    grace period in parallel, not in turn): those that use the others, then the `backing` ones,
    so that each stops while what it uses still runs. A flow server pauses its deployments on
    the Prefect server as it stops: stopped together with that server, it retried until killed
    (10 s, where it takes 0.5 s before it); a worker stops before the MLflow server it follows.
    One that fails to stop (it outlives SIGKILL) leaves none of the others running: the first
    error is raised once every service was stopped."""
    errors: list[BaseException] = []
    for backing in (False, True):
        step = [service for service in services if service.backing is backing]
        with ThreadPoolExecutor(max(1, len(step))) as pool:
            stops = [pool.submit(service.stop) for service in step]
        errors += [error for stop in stops if (error := stop.exception()) is not None]
    if errors:
        raise errors[0]


def responds_ok(url: str, headers: Mapping[str, str] | None = None) -> bool:
    """Whether `url` responds 200 right now: a health probe. `headers`: e.g. `basic_auth`'s,
    for a Prefect server with an auth string; by default, a probe of the Prefect API this
    process points at (PREFECT_API_URL) sends its PREFECT_API_AUTH_STRING, as Prefect's own
    client does: without it, that API answers 401."""
    if headers is None:
        api = os.environ.get("PREFECT_API_URL", "")
        secret = os.environ.get("PREFECT_API_AUTH_STRING", "")
        headers = basic_auth(secret) if api and url.startswith(api) else {}
    try:
        request = urllib.request.Request(url, headers=dict(headers))
        with urllib.request.urlopen(request, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def start_process(
    name: str,
    argv: Sequence[str],
    url: str,
    health: str | Callable[[], bool],
    log_path: Path,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 120.0,
    die_with_parent: bool = False,
    grace_s: float = 10.0,
    backing: bool = False,
) -> ManagedProcess:
    """Start `argv` and return once it is healthy: `url + health` answers 200 (a path), or
    `health()` is true (a check); ServiceError if it exits or times out first.
    `die_with_parent`: the process gets SIGTERM when the thread that started it ends (Linux),
    so a child this process supervises never outlives it, even when it is SIGKILLed.
    `grace_s`: how long it may take to shut down when stopped (see `ManagedProcess.stop`).
    `backing`: other services use it (see `stop_all`)."""
    healthy = health if callable(health) else lambda: responds_ok(url + health)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            term_with_parent(argv) if die_with_parent else list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    service = ManagedProcess(name, process, url, log_path, grace_s, backing=backing)
    try:
        wait_healthy(service, healthy, timeout_s)
    except BaseException:
        service.stop()  # whatever it forked before failing, too
        raise
    return service


TERM_WITH_PARENT = """
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    sys.exit("its parent exited before it could start")
os.execvp(sys.argv[2], sys.argv[2:])
"""
"""Run as `python -c` before the service: asks Linux for SIGTERM when the thread that started
it ends, then execs the service (the request survives exec)."""


_starting = threading.local()
"""In a thread of `start_together`: `called_off`, the event set when its starts are called off."""


def start_together(starts: Sequence[Callable[[], ManagedProcess]]) -> list[ManagedProcess]:
    """Call `starts` at once, each in a thread of its own (each returns once its service is
    healthy), and return their services in order once all are: services that wait on nothing
    but their own start-up (MLflow and Prefect) start in the time of the slowest, not the sum.
    If one fails, or this thread is interrupted (Ctrl-C), the others' waits are called off and
    every service that did start is stopped before the error is raised: nothing is left running.
    Not for a start with `die_with_parent`: its thread ends here, and its process with it.
    A single start runs in this thread, as it would without `start_together`."""
    if len(starts) == 1:
        return [starts[0]()]
    called_off = threading.Event()

    def start_in_thread(start: Callable[[], ManagedProcess]) -> ManagedProcess:
        _starting.called_off = called_off
        return start()

    pool = ThreadPoolExecutor(len(starts), thread_name_prefix="start")
    futures = [pool.submit(start_in_thread, start) for start in starts]
    try:
        wait(futures, return_when=FIRST_EXCEPTION)
        failed = [future.exception() for future in futures if future.done()]
        first = next((error for error in failed if error is not None), None)
        if first is not None:
            raise first
        return [future.result() for future in futures]
    except BaseException:
        called_off.set()
        pool.shutdown(wait=True)
        stop_all([future.result() for future in futures if future.exception() is None])
        raise
    finally:
        pool.shutdown(wait=True)


def term_with_parent(argv: Sequence[str]) -> list[str]:
    """`argv` behind a small Python that gets it SIGTERM when the thread that started it
    ends, asked for in the child itself: not through Popen's `preexec_fn`, which runs Python
    between fork and exec and can deadlock a threaded program (a worker is one). Where Linux's
    prctl is not, `argv` as it is."""
    if sys.platform != "linux":
        return list(argv)
    # -I -S: the shim starts in tens of milliseconds and reads nothing from the environment.
    return [sys.executable, "-I", "-S", "-c", TERM_WITH_PARENT, str(os.getpid()), *argv]


def wait_healthy(service: ManagedProcess, healthy: Callable[[], bool], timeout_s: float) -> None:
    """Return once `healthy()`; ServiceError naming its log if it exits or times out first."""
    deadline = time.monotonic() + timeout_s
    called_off = getattr(_starting, "called_off", None)
    while time.monotonic() < deadline:
        if called_off is not None and called_off.is_set():
            raise ServiceError(f"{service.name}: its start was called off")
        if service.process.poll() is not None:
            raise ServiceError(
                f"{service.name} exited with code {service.process.returncode} while starting; "
                + service.log_excerpt()
            )
        if healthy():
            return
        time.sleep(0.2)
    raise ServiceError(
        f"{service.name} was not healthy{f' at {service.url}' if service.url else ''} within "
        f"{timeout_s:.0f} s; " + service.log_excerpt()
    )
