"""MLflow stopped while the pipeline talks to it, with real `mlflow server` processes that the
tests stop and start again: a short outage is waited out (the call completes once the server is
back); a long one is said on the terminal in one line with the bound (MINT_REGISTRY_RETRY_S),
then fails the release in one line once the bound has passed, and nothing is registered."""

import logging
import os
import re
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from control.services import start_mlflow
from mint_core.artifacts.digests import sha256_json
from mint_core.model.base import BaseModel
from mint_core.registry import Registry
from mint_core.registry_outages import LOGGER, wait_out_registry_outages
from processes import ManagedProcess
from tests.helpers import make_policy
from tests.integration.helpers import mint_env, start_mint, toy_data, wait_for

RETRY_S = 5
"""The bound the release test sets: small, so the test is quick."""


def port_of(server: ManagedProcess) -> int:
    return int(server.url.rsplit(":", 1)[1])


@pytest.fixture
def own_mlflow(tmp_path: Path) -> Iterator[list[ManagedProcess]]:
    """An MLflow server this test may stop and start again (the session's must stay up): the
    list holds each start, the last one current; whatever runs at the end is stopped."""
    servers = [start_mlflow(tmp_path / "registry")]
    yield servers
    for server in servers:
        server.stop()


def test_a_registry_call_waits_out_a_short_outage(
    own_mlflow: list[ManagedProcess],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """As the commands that run the pipeline are set up: MLflow's client does not retry on its
    own, MinT waits out the outage."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    wait_out_registry_outages(120)
    try:
        server = own_mlflow[0]
        registry = Registry(server.url)
        adapter = f"outage-{uuid.uuid4().hex[:8]}"
        digest = sha256_json(["test_registry_outage", adapter])
        policy = make_policy(adapter=adapter, content_digest=digest)
        uri = "mint-local://sha256/" + digest.removeprefix("sha256:")

        server.stop()
        caplog.set_level(logging.WARNING, logger=LOGGER)
        registered: list[object] = []
        call = threading.Thread(
            target=lambda: registered.append(
                registry.revisions.register(policy, uri, policy.base_digest)
            )
        )
        call.start()
        time.sleep(2)  # the call meets the stopped server and waits
        assert call.is_alive() and not registered
        own_mlflow.append(start_mlflow(tmp_path / "registry", port_of(server)))
        call.join(120)
        assert not call.is_alive(), "the call did not complete once MLflow was back"
    finally:
        wait_out_registry_outages(0)

    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 2, lines
    assert re.match(
        rf"MLflow at {server.url} \(MLFLOW_TRACKING_URI\) does not answer \(.*Connection refused.*"
        r"\); trying again for up to 120 s \(MINT_REGISTRY_RETRY_S\)$",
        lines[0],
    ), lines[0]
    assert re.match(rf"MLflow at {server.url} answers again, after \d+ s$", lines[1]), lines[1]
    (revision,) = [r.id for r in registry.revisions.of(adapter)]  # one, written whole
    assert registry.revisions.get(revision).policy == policy


@pytest.mark.slow
def test_a_release_with_mlflow_down_says_so_and_fails_at_its_bound_registering_nothing(
    base: BaseModel,
    own_mlflow: list[ManagedProcess],
    started: list[subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    (home / "base").mkdir(parents=True)
    os.symlink(base.path, home / "base" / base.path.name)  # the session's, already pretrained
    server = own_mlflow[0]
    env = mint_env(
        MINT_HOME=str(home),
        MLFLOW_TRACKING_URI=server.url,
        MINT_WORKER_URLS=server.url,  # only reachability is checked before training
        MINT_REGISTRY_RETRY_S=str(RETRY_S),
    )
    adapter = "outage-bot"
    data, _ = toy_data(home, "upper", rows=64)
    output = tmp_path / "release.out"
    release = start_mint(
        started, ["release", "--adapter", adapter, "--data", data, "--steps", "3000"], env, output
    )
    log = home / "logs" / "mint-release.log"
    wait_for(lambda: log.exists() and "training step" in log.read_text(), release, output, 600)

    server.stop()  # training goes on; its next loss report meets a stopped server
    stopped = time.monotonic()
    code = release.wait(300)
    seconds = time.monotonic() - stopped
    said = output.read_text()
    print(f"release failed {seconds:.1f} s after MLflow stopped (bound {RETRY_S} s)\n{said}")

    assert code == 1, said
    assert "Traceback" not in said and "urllib3" not in said and "Retrying" not in said, said
    waiting = [line for line in said.splitlines() if "MINT_REGISTRY_RETRY_S)" in line]
    assert len(waiting) == 1, said
    assert re.fullmatch(
        rf"mint release: MLflow at {re.escape(server.url)} \(MLFLOW_TRACKING_URI\) does not "
        rf"answer \(.*Connection refused.*\); trying again for up to {RETRY_S} s "
        r"\(MINT_REGISTRY_RETRY_S\)",
        waiting[0],
    ), waiting[0]
    last = said.strip().splitlines()[-1]
    assert re.match(
        rf"mint release: MLflow at {re.escape(server.url)} \(MLFLOW_TRACKING_URI\) did not "
        rf"answer \w+ for "
        rf"\d+ s \(MINT_REGISTRY_RETRY_S={RETRY_S}\): .*Connection refused",
        last,
    ), last
    # The bound, plus what a loaded machine takes to wind the flow run down.
    assert seconds < RETRY_S + 60, f"failed {seconds:.1f} s after MLflow stopped"

    own_mlflow.append(start_mlflow(tmp_path / "registry", port_of(server)))
    assert not Registry(server.url).revisions.has_adapter(adapter)
