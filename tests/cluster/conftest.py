"""The cluster lane: hosts as network namespaces on one machine (tests/cluster/netns.py).

Namespaces need root and iproute2. Where they cannot be made, the tests here are skipped with
the reason; but with MINT_CLUSTER_TESTS=required (the Makefile sets it when run as root, as CI
is) the same conditions fail them: CI never skips the cluster silently. At the end of the run
anything left of a cluster this run made (a namespace, a link) fails it, and the summary says
how long the lane took (under pytest-xdist, the worker that ran the lane tells the controller).
"""

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import boot, netns, roles

REQUIRED = "MINT_CLUSTER_TESTS"
"""`required`: a cluster test that cannot make namespaces fails instead of being skipped."""

_durations: dict[str, float] = {}
_boot_s: dict[str, float] = {}
_left: list[str] = []
"""Namespaces and links of this run's clusters still there at an xdist worker's end."""
BOOT_OUTPUT = "cluster_boot_s"
LEFT_OUTPUT = "cluster_left"
"""The keys an xdist worker hands the boot times and the leftovers to the controller under."""


@pytest.fixture(scope="session")
def namespaces_ok() -> None:
    """Skip (or, when required, fail) unless network namespaces can be made here."""
    reason = netns.unavailable()
    if reason is None:
        return
    if os.environ.get(REQUIRED) == "required":
        pytest.fail(f"{REQUIRED}=required, but the cluster cannot run: {reason}", pytrace=False)
    pytest.skip(f"no test cluster: {reason}")


@pytest.fixture
def small_cluster(namespaces_ok: None, tmp_path: Path) -> Iterator[netns.Cluster]:
    """Two bare hosts, `server` and `client`, for the harness's own test."""
    with netns.Cluster(["server", "client"], tmp_path) as cluster:
        yield cluster


@pytest.fixture(scope="package")  # down before the integration lane starts: not 40 min idle
def mint_cluster(namespaces_ok: None, mint_home: Path, session_dir: Path) -> Iterator[roles.Booted]:
    """Every role of MinT booted in its host (tests/cluster/boot.py, which bench/cluster.py
    shares), once for the lane. The base is built under the session's MINT_HOME first (the
    integration lane reuses it). Once it is down, ctl and the train hosts must have said they
    stopped what they started (`roles.check_stopped`)."""
    with boot.booted_cluster(mint_home, session_dir) as booted:
        _boot_s.update(booted.boot_s)
        yield booted
    roles.check_stopped(booted)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.nodeid.startswith("tests/cluster/"):
        _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _durations:
        total = sum(_durations.values())
        terminalreporter.write_line(
            f"cluster lane: {len(_durations)} tests, {total:.1f} s (set-up and teardown included)"
        )
    if _boot_s:
        hosts = ", ".join(f"{h} {s:.0f} s" for h, s in _boot_s.items() if h not in ("all", "base"))
        terminalreporter.write_line(
            f"cluster boot: {_boot_s['all']:.1f} s ({hosts}), after building the base in "
            f"{_boot_s['base']:.1f} s (which the integration lane then reuses)"
        )


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's controller: a worker process ended
def pytest_testnodedown(node: Any, error: object) -> None:
    # The worker that ran the lane says what the summary and the check below need.
    output = getattr(node, "workeroutput", {})
    _boot_s.update(output.get(BOOT_OUTPUT, {}))
    _left.extend(output.get(LEFT_OUTPUT, []))


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    left = [
        name
        for cluster in netns.MADE
        for name in netns.leftovers(cluster.namespaces, cluster.links)
    ]
    if left:
        for cluster in netns.MADE:
            netns.remove(cluster.tag, cluster.namespaces, cluster.links)
    if (workeroutput := getattr(session.config, "workeroutput", None)) is not None:
        workeroutput[BOOT_OUTPUT] = _boot_s
        workeroutput[LEFT_OUTPUT] = left
        return
    left += _left
    if not left:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_sep("=", f"the test cluster left {len(left)} namespaces/links", red=True)
        reporter.write_line(" ".join(left))
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
