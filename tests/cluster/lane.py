"""The cluster lane's end of the run, a plugin of the whole run (tests/conftest.py loads it):
anything left of a cluster this run made (a namespace, a link) fails the run, and the summary
says how long the lane took and its boot. Under pytest-xdist the controller runs no tests and
loads no conftest below tests/: the worker that ran the lane hands it what it found
(`workeroutput`), and the controller reports.
"""

from typing import Any

import pytest

from tests.cluster import netns

BOOT_S: dict[str, float] = {}
"""The lane's boot, by host (and "all", "base"): set by the `mint_cluster` fixture."""
_durations: dict[str, float] = {}
_left: list[str] = []
"""Namespaces and links of this run's clusters that an xdist worker found at its end."""
BOOT_OUTPUT = "cluster_boot_s"
LEFT_OUTPUT = "cluster_left"
"""The keys an xdist worker hands the boot times and the leftovers to the controller under."""


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.nodeid.startswith("tests/cluster/"):
        _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's controller: a worker process ended
def pytest_testnodedown(node: Any, error: object) -> None:
    output = getattr(node, "workeroutput", {})
    BOOT_S.update(output.get(BOOT_OUTPUT, {}))
    _left.extend(output.get(LEFT_OUTPUT, []))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _durations:
        total = sum(_durations.values())
        terminalreporter.write_line(
            f"cluster lane: {len(_durations)} tests, {total:.1f} s (set-up and teardown included)"
        )
    if BOOT_S:
        hosts = ", ".join(f"{h} {s:.0f} s" for h, s in BOOT_S.items() if h not in ("all", "base"))
        terminalreporter.write_line(
            f"cluster boot: {BOOT_S['all']:.1f} s ({hosts}), after {BOOT_S['base']:.1f} s for "
            "the base (built once per run, or waited for)"
        )


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
        workeroutput[BOOT_OUTPUT] = BOOT_S
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
