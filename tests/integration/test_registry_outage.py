"""MLflow stopped while the pipeline talks to it, with real `mlflow server` processes that the
tests stop and start again: a short outage is waited out (the call completes once the server is
back); a long one is said on the terminal in one line with the bound (MINT_REGISTRY_RETRY_S),
then fails the release in one line once the bound has passed, and nothing is registered."""

import contextlib
import logging
import os
import re
import socket
import struct
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from control.services import start_mlflow
from mint_core.artifacts.digests import sha256_json
from mint_core.config import MintConfig
from mint_core.model.base import BaseModel
from mint_core.registry import Registry
from mint_core.registry_outages import LOGGER, wait_out_registry_outages
from processes import ManagedProcess
from processes.managed import free_port
from tests.helpers import make_policy, wait_until
from tests.integration.helpers import mint_env, start_mint, toy_data, wait_for

RETRY_S = 5
"""The bound the release test sets: small, so the test is quick."""
OUTAGE_MET_S = 60.0
"""Longest wait for a call to meet a stopped server (its first try is refused at once): slack
for a loaded machine, yet well inside the 120 s the short-outage test waits outages out for,
so the call is still waiting when the server comes back."""


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
        # The call meets the stopped server (it says so in the log) and waits.
        wait_until(
            lambda: any(
                r.name == LOGGER and "does not answer" in r.getMessage() for r in caplog.records
            ),
            timeout_s=OUTAGE_MET_S,
        )
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


class CuttableLink:
    """A TCP relay in front of a server that a test cuts off and brings back: cut, it refuses
    new connections and resets the open ones (a request in flight gets no answer); rejoined,
    it listens again on the same port."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = free_port()
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self.rejoin()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def rejoin(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        assert self._listener is not None
        with contextlib.suppress(OSError):  # wakes its accept(), which close() alone does not
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            for conn in self._open:
                with contextlib.suppress(OSError):
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    conn.close()
            self._open.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            with self._lock:
                self._open |= {client, server}
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


STEPS = 150
"""The training's steps: a cut at the 30th, held until it made 40 more (or MAX_CUT_S passed)."""
MIN_CUT_S = 3.0
MAX_CUT_S = 90.0
"""The longest the link stays cut (under MINT_REGISTRY_RETRY_S, which the test sets to 120):
training that made too few steps meanwhile fails the test, on a busy machine too."""


def step_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, float, float]]:
    """(step, loss, when) of each `training step` line so far."""
    found = []
    for record in list(caplog.records):
        if record.getMessage().startswith("training step "):
            step, _total, loss = record.args[:3]  # type: ignore[index,misc]
            found.append((int(step), float(loss), record.created))
    return found


@pytest.mark.slow
def test_training_goes_on_while_mlflow_is_cut_off_and_its_losses_arrive_once_in_order(
    mlflow_server: ManagedProcess,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A release's training (a tiny base) whose MLflow is cut off (for at least MIN_CUT_S,
    until training made twice LOG_EVERY steps: before, training stopped within LOG_EVERY steps,
    at its next report): its steps go on through the cut (each step's log line, timed), and
    afterwards the run's train_loss has every step once, in order, with the loss it logged."""
    from mint_core.model import toy
    from mint_core.model.base import BaseSource
    from mint_core.model.tiny import TinySpec, ensure_tiny
    from mint_core.model.training import TrainingConfig
    from tasks.training import _TrainingProgress, load_data, train_adapter

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # as `mint release` runs
    monkeypatch.setattr(_TrainingProgress, "LOG_LINES", 10**9)  # a timed line per step
    link = CuttableLink(("127.0.0.1", port_of(mlflow_server)))
    tiny = TinySpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                    pretrain_steps=0)  # fmt: skip
    base = BaseSource(str(ensure_tiny(tiny, tmp_path / "base")))
    config = MintConfig(home=tmp_path, tracking_uri=link.url, base=base)
    data = toy.write_task_data(toy.Task.UPPER, tmp_path / "data", rows=64)
    adapter = f"cut-{uuid.uuid4().hex[:6]}"
    rows, held_out = load_data.fn(config, str(data), None, 0.1, adapter)
    caplog.set_level(logging.INFO, logger="tasks.runs")
    wanted = 2 * _TrainingProgress.LOG_EVERY
    trained: list[object] = []
    wait_out_registry_outages(120)
    training = threading.Thread(
        target=lambda: trained.append(
            train_adapter.fn(config, adapter, rows, held_out, TrainingConfig(steps=STEPS))
        )
    )
    try:
        training.start()
        deadline = time.monotonic() + 600
        while len(step_lines(caplog)) < 30:  # under way, its loss reported at least once
            assert training.is_alive() and time.monotonic() < deadline
            time.sleep(0.05)
        cut_at = time.time()
        link.cut()
        while (
            time.time() < cut_at + MAX_CUT_S
            and training.is_alive()
            and (
                time.time() < cut_at + MIN_CUT_S
                or sum(1 for _s, _l, at in step_lines(caplog) if at >= cut_at) < wanted
            )
        ):
            time.sleep(0.05)
        rejoined_at = time.time()
        link.rejoin()
        training.join(600)
        assert not training.is_alive()
    finally:
        wait_out_registry_outages(0)

    lines = step_lines(caplog)
    during = [step for step, _loss, at in lines if cut_at <= at <= rejoined_at]
    before = [at for _step, _loss, at in lines if at < cut_at]
    rate = len(before) / (before[-1] - before[0])
    print(f"MLflow cut off for {rejoined_at - cut_at:.1f} s: {len(during)} steps made meanwhile "
          f"({rate:.1f} steps/s before it)")  # fmt: skip
    assert trained, "training failed"
    assert [step for step, _loss, _at in lines] == list(range(1, STEPS + 1))
    assert len(during) >= wanted, (
        f"{len(during)} steps in the {rejoined_at - cut_at:.0f} s MLflow was cut off"
    )
    run_id = str(trained[0].run_id)  # type: ignore[attr-defined]
    history = MlflowClient(mlflow_server.url).get_metric_history(run_id, "train_loss")
    history.sort(key=lambda m: (m.timestamp, m.step))
    assert [m.step for m in history] == list(range(1, STEPS + 1))  # each once, in order
    assert [m.value for m in history] == [loss for _step, loss, _at in lines]
