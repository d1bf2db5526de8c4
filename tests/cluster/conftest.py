"""The cluster lane: hosts as network namespaces on one machine (tests/cluster/netns.py).

Namespaces need root and iproute2. Where they cannot be made, the tests here are skipped with
the reason; but with MINT_CLUSTER_TESTS=required (the Makefile sets it when run as root, as CI
is) the same conditions fail them: CI never skips the cluster silently. At the end of the run
anything left of a cluster this run made (a namespace, a link) fails it, and the summary says
how long the lane took: tests/cluster/lane.py, a plugin of the whole run.
"""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import boot, lane, netns, roles

REQUIRED = "MINT_CLUSTER_TESTS"
"""`required`: a cluster test that cannot make namespaces fails instead of being skipped."""


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
        lane.BOOT_S.update(booted.boot_s)
        yield booted
    roles.check_stopped(booted)
