"""What every lane shares: the run's environment (set before any test module imports Prefect,
MLflow or boto3), a temporary session folder with MINT_HOME in it, and the session-end check
that no process the tests started outlives them. The lanes add their own: tests/unit/conftest.py
refuses processes; tests/integration/conftest.py starts a tiny base, a real `mlflow server`, real
workers and Prefect's local API, all on loopback, once per session and always stopped."""

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

# Prefect reads its settings when first imported, and a bare import writes to PREFECT_HOME:
# point it at a temporary folder before any test module imports it.
_SESSION_DIR = Path(tempfile.mkdtemp(prefix="mint-tests-"))
os.environ["PREFECT_HOME"] = str(_SESSION_DIR / "prefect")
# What every test process would build alike is built once per run, under the first process's
# session folder: pytest-xdist's test processes inherit its environment, and it removes the
# folder last, once they have ended.
_RUN_DIR = Path(os.environ.setdefault("MINT_TESTS_RUN_DIR", str(_SESSION_DIR)))
os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "120"
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["DO_NOT_TRACK"] = "1"
os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
os.environ.pop("PREFECT_API_URL", None)
# boto3 needs credentials; these are moto's dummies. Every S3 client in the tests names the
# loopback moto server as its endpoint, and the metadata service is never asked.
os.environ.update(
    AWS_ACCESS_KEY_ID="mint-tests",
    AWS_SECRET_ACCESS_KEY="mint-tests",
    AWS_DEFAULT_REGION="us-east-1",
    AWS_EC2_METADATA_DISABLED="true",
)

# Under pytest-xdist (`make test`) each test process gets its share of the cores for torch's
# threads, and passes it on to what it starts: two processes running 2-thread kernels on 2
# cores, with the workers and trainers they start, spin against each other (OpenMP waits busily).
if (processes := os.environ.get("PYTEST_XDIST_WORKER_COUNT")) is not None:
    cores = len(os.sched_getaffinity(0))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // int(processes))))

# The session-end checks: a run fails if a process it started outlives it, or a namespace or
# link of a test cluster it made (and says how long the cluster lane took).
pytest_plugins = ["tests.process_leaks", "tests.cluster.lane"]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    # How fast this machine is, in CI's log beside the lanes' times: a suite's minutes on
    # another machine are compared through it (a CPU-bound lane scales with it).
    cpus = len(os.sched_getaffinity(0))
    terminalreporter.write_line(
        f"machine: {cpus} cpus; a fixed Python loop (1e7 additions) took {_loop_s():.3f} s "
        "(best of 3)"
    )


def _loop_s() -> float:
    times = []
    for _ in range(3):
        started = time.perf_counter()
        sum(range(10_000_000))
        times.append(time.perf_counter() - started)
    return min(times)


CLUSTER_GROUP = "tests/cluster"
BACKENDS_GROUP = "tests/integration/backends"
FOLDER_GROUPS = (CLUSTER_GROUP, BACKENDS_GROUP)
"""Folders whose tests share what their conftest starts (the cluster lane's booted cluster, the
backend contract's mixed fleet): each runs in one process."""
LONGEST_GROUPS = (
    CLUSTER_GROUP,
    "tests/integration/test_cli.py",
    "tests/integration/test_lifecycle.py",
    "tests/integration/test_benchmarks.py",
    "tests/integration/test_release.py",
    "tests/integration/test_eval_gate.py",
    BACKENDS_GROUP,
    "tests/integration/test_trainer.py",
    "tests/integration/test_canary_flow.py",
    "tests/integration/test_default_base.py",
)
"""The groups that take longest (4 to 8 min each with both cores busy, measured on 2 cores),
longest first: they start first, so that none of them ends the run with the other core idle
(xdist would start them by their number of tests, some of them last)."""


def xdist_group(nodeid: str) -> str:
    """The tests that run in one process when `make test` spreads a lane over both cores: a
    module's (its module fixtures start once), and a grouped folder's (FOLDER_GROUPS)."""
    module = nodeid.split("::")[0]
    return next((f for f in FOLDER_GROUPS if module.startswith(f + "/")), module)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: `make test` runs with -n 2
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        """xdist's load-by-scope with `xdist_group`'s groups (its own `--dist loadgroup` reads
        the groups from the test ids, which pytest 9.2 no longer lets it change)."""

        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid)

        def _assign_work_unit(self, node: object) -> None:
            for group in reversed(LONGEST_GROUPS):
                if group in self.workqueue:
                    self.workqueue.move_to_end(group, last=False)
            super()._assign_work_unit(node)  # type: ignore[arg-type]

    return ByGroup(config, log)  # type: ignore[arg-type]


@pytest.hookimpl(trylast=True)  # after pytest has torn the fixtures down
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_SESSION_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def session_dir() -> Path:
    """The run's temporary folder (Prefect's home among others), removed at the end."""
    return _SESSION_DIR


@pytest.fixture(scope="session")
def mint_home(session_dir: Path) -> Path:
    """The session's MINT_HOME, its embedded default base linked from the run's."""
    home, default = session_dir / "mint", _default_base()
    (home / "base").mkdir(parents=True, exist_ok=True)
    if not (link := home / "base" / default.name).exists():
        link.symlink_to(default, target_is_directory=True)
    return home


def _default_base() -> Path:
    """The embedded default base, built by the first test process that needs it (about 20 s
    of pretraining on 2 cores) while the others wait, then taken as it is."""
    import fcntl

    from mint_core.model.tiny import TinySpec, ensure_tiny

    with (_RUN_DIR / "default-base.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return ensure_tiny(TinySpec(), _RUN_DIR / "default-base")
