"""What every benchmark shares: its command line, a scratch folder whose services stop on the
way out, clocks for timing cases side by side, the figures taken from the samples, the machine
it ran on, and writing the results.

A benchmark measures its comparison in one run, the cases taking turns where they can (this
machine is noisy: ratios and medians, never single timings), prints its figures and writes them
with every sample to bench/results/<name>.json (`--out` elsewhere), with its picture next to it.
"""

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from bench import plots
from control.services import start_mlflow
from mint_core.registry_accounts import RegistryAccounts
from processes import ManagedProcess, stop_all

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_HOME = Path(__file__).resolve().parents[1] / ".mint"
"""The MinT home whose embedded default base a benchmark uses: `make demo`'s."""


def command_line(doc: str | None, name: str) -> argparse.ArgumentParser:
    """The benchmark's parser: its docstring as help, and `--out`, by default
    bench/results/`name`.json."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument(
        "--out", type=Path, default=RESULTS / f"{name}.json", help="where the JSON goes"
    )
    return parser


def add_home(parser: argparse.ArgumentParser) -> None:
    """`--home`: where the benchmark finds the embedded default base, or builds it once."""
    parser.add_argument(
        "--home", type=Path, default=DEFAULT_HOME,
        help="the MinT home whose embedded default base is used, built there first if missing",
    )  # fmt: skip


def default_base(home: Path) -> Path:
    """The embedded default base's folder in `home`, built and pretrained there first if missing
    (about 20 s on 2 cores): kept between runs, as `mint` keeps it."""
    from mint_core.model.tiny import TinySpec, ensure_tiny

    return ensure_tiny(TinySpec(), home.absolute() / "base")


def write(out: Path, result: Mapping[str, Any]) -> None:
    """The JSON, and next to it the benchmark's picture (bench/plots.py); the benchmark is the
    script being run, `bench/<name>.py`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    png = plots.draw(Path(sys.argv[0]).stem, result, out.with_suffix(".png"))
    if png is not None:
        print(f"drew {png}")


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""Signals that stop a benchmark as Ctrl-C does, inside `scratch`: Python's default for them
ends the process at once, and a benchmark stopped with SIGTERM left its MLflow and worker
running."""


@contextmanager
def scratch(name: str, parent: Path | None = None) -> Iterator[tuple[Path, list[ManagedProcess]]]:
    """A temporary folder and a list for the services started for the run: on the way out,
    whatever happened, the services are stopped and the folder removed. Inside it, SIGTERM and
    SIGHUP (`STOP_SIGNALS`) interrupt the run as Ctrl-C does, and once one has, further ones
    are ignored until the services are stopped."""
    work = Path(tempfile.mkdtemp(prefix=f"mint-bench-{name}-", dir=parent))
    services: list[ManagedProcess] = []
    previous = _interrupt_on_stop_signals()
    try:
        yield work, services
    finally:
        try:
            stop_all(services)
            shutil.rmtree(work, ignore_errors=True)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _interrupt_on_stop_signals() -> dict[int, Any]:
    """Make `STOP_SIGNALS` and SIGINT raise KeyboardInterrupt, then ignore them all once one
    has (the cleanup it starts must not be cut short); their handlers before. Only the main
    thread may set handlers: elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def interrupt(signum: int, _frame: object) -> None:
        for sig in (signal.SIGINT, *STOP_SIGNALS):
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")

    return {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, *STOP_SIGNALS)}


def start_registry(folder: Path, services: list[ManagedProcess]) -> ManagedProcess:
    """MLflow as `mint registry` runs it, its basic-auth app guarding MinT's accounts (in
    `services`): this process signs in as the pipeline (MLflow's client reads its credentials
    from the environment at each request), and so do the processes it starts unless they are
    given `worker_env` (workers and gateways read as the worker, as deployed)."""
    accounts = RegistryAccounts.generate()
    mlflow = start_mlflow(folder, accounts=accounts)
    services.append(mlflow)
    os.environ.update(accounts.pipeline.env())
    return mlflow


def worker_env(mlflow: ManagedProcess) -> dict[str, str]:
    """The environment that signs a worker or a gateway in to `mlflow` (started by
    `start_registry`) with the worker's account."""
    assert mlflow.accounts is not None, "an MLflow started by start_registry"
    return mlflow.accounts.worker.env()


class Clock:
    """Seconds per stage, in order, from one start."""

    def __init__(self) -> None:
        self.stages: dict[str, float] = {}
        self._last = time.perf_counter()

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        yield
        now = time.perf_counter()
        self.stages[name] = now - self._last
        self._last = now

    @property
    def total(self) -> float:
        return sum(self.stages.values())


def evict(paths: Iterable[Path]) -> None:
    """Drop the files' pages from the page cache, so that the next read comes from the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def median_stages(clocks: Sequence[Clock]) -> dict[str, float]:
    return {name: statistics.median(c.stages[name] for c in clocks) for name in clocks[0].stages}


def seconds(run: Callable[[], object]) -> float:
    """How long one run of `run` took."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def repeated(
    run: Callable[[], object], runs: int, before: Callable[[], None] | None = None
) -> list[float]:
    """Seconds of each of `runs` runs of `run`; `before` (outside the clock) precedes each."""
    times = []
    for _ in range(runs):
        if before is not None:
            before()
        times.append(seconds(run))
    return times


def interleaved(cases: Mapping[str, Callable[[], object]], runs: int) -> dict[str, list[float]]:
    """Seconds of each run of each case, `runs` rounds in which the cases take turns, so that
    drift hits every case alike."""
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(runs):
        for name, run in cases.items():
            samples[name].append(seconds(run))
    return samples


def alternating(number: int, cases: Sequence[str]) -> Sequence[str]:
    """The order of the cases in run `number`: reversed every other run, so neither always
    goes first."""
    return cases if number % 2 == 0 else cases[::-1]


def percentile(values: Sequence[float], q: float) -> float:
    """The sample at rank `q` (nearest rank over the sorted samples)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """The machine a run measured, its load at the end included."""
    import torch  # only here: the benchmarks that need no torch do not load it

    return {
        "cpu": cpu_name(),
        "cpus": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 1e9, 1),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average_1m_at_end": os.getloadavg()[0],
    }
