"""Every HTTP service (worker, gateway, trainer) closes connections that keep it waiting: one
that sends nothing, half a request head, or half a body, and one left idle after its answer,
each within its bound (MINT_HTTP_BOUNDS) while /health answers; a half-sent body is answered
408 in MinT's error shape. The worker runs the default bounds; the gateway and the trainer
shorter ones, and the gateway a small connection limit, which answers 503 in that shape."""

import dataclasses
import json
import selectors
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from mint_core.config import MintConfig
from mint_core.connections import ConnectionBounds
from processes import ManagedProcess
from serving.gateway import start_gateway
from trainer.server import start_trainer

pytestmark = pytest.mark.slow

EACH = 20
"""Hostile connections of each kind per service."""
MARGIN_S = 5.0
"""Slack over a bound for a busy 2-core machine."""
SHORT = ConnectionBounds(keep_alive_s=2, head_s=3, body_s=3, connections=120)
OVER_CAPACITY_TRIES = round(SHORT.head_s + MARGIN_S)
"""Most tries after a refusal at the connection limit, each after the Retry-After it says (1 s):
their waits add up to head_s + MARGIN_S, the time idle connections have to be closed by, and
being counted in tries, slow answers on a busy machine do not spend it."""
TRAINER_KEY = "tml-team-a"


@pytest.fixture(scope="module")
def gateway(fleet_config: MintConfig) -> Iterator[ManagedProcess]:
    process = start_gateway(dataclasses.replace(fleet_config, http_bounds=SHORT))
    yield process
    process.stop()


@pytest.fixture(scope="module")
def trainer(config: MintConfig) -> Iterator[ManagedProcess]:
    keys = {TRAINER_KEY: "team-a"}
    process = start_trainer(dataclasses.replace(config, api_keys=keys, http_bounds=SHORT))
    yield process
    process.stop()


def head(path: str, key: str, length: int | None = None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: mint", f"Authorization: Bearer {key}"]
    lines += [f"X-API-Key: {key}", "Content-Type: application/json"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def hostile(url: str, path: str, key: str) -> dict[str, list[socket.socket]]:
    """`EACH` connections of each kind, opened to `url`; `path` takes a JSON body."""
    full = f"GET /health HTTP/1.1\r\nHost: mint\r\nX-API-Key: {key}\r\n\r\n".encode()
    sent = {
        "idle": b"",
        "half head": head(path, key)[:40],
        "half body": head(path, key, length=200) + b'{"prompt": "hel',
        "after answer": full,
    }
    address = urlsplit(url)
    kinds: dict[str, list[socket.socket]] = {}
    for kind, data in sent.items():
        for _ in range(EACH):
            s = socket.create_connection((address.hostname, address.port))
            s.sendall(data)
            kinds.setdefault(kind, []).append(s)
    return kinds


def watch(url: str, kinds: dict[str, list[socket.socket]], limit_s: float) -> dict[str, object]:
    """When each connection was closed (seconds, None if still open at `limit_s`) and what it
    was sent, while /health is asked once a second."""
    start = time.monotonic()
    selector = selectors.DefaultSelector()
    received: dict[socket.socket, bytes] = {}
    closed: dict[socket.socket, float] = {}
    for sockets in kinds.values():
        for s in sockets:
            selector.register(s, selectors.EVENT_READ)
            received[s] = b""
    health: list[int] = []
    next_health = start
    while len(closed) < len(received) and time.monotonic() - start < limit_s:
        if time.monotonic() >= next_health:
            health.append(httpx.get(f"{url}/health", timeout=10).status_code)
            next_health += 1.0
        for key, _ in selector.select(timeout=0.2):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            try:
                data = s.recv(65536)
            except ConnectionError:
                data = b""
            received[s] += data
            if not data:
                closed[s] = time.monotonic() - start
                selector.unregister(s)
    for s in received:
        s.close()
    return {
        "health": health,
        "closed": {kind: [closed.get(s) for s in sockets] for kind, sockets in kinds.items()},
        "answers": {kind: [received[s] for s in sockets] for kind, sockets in kinds.items()},
    }


def check(url: str, path: str, key: str, bounds: ConnectionBounds) -> None:
    kinds = hostile(url, path, key)
    seen = watch(url, kinds, max(bounds.head_s, bounds.body_s) + 2 * MARGIN_S)
    assert set(seen["health"]) == {200}, seen["health"]  # type: ignore[arg-type]
    closed: dict[str, list[float | None]] = seen["closed"]  # type: ignore[assignment]
    due = {
        "idle": bounds.head_s,
        "half head": bounds.head_s,
        "half body": bounds.body_s,
        "after answer": bounds.keep_alive_s,
    }
    late = {
        kind: times
        for kind, times in closed.items()
        if any(t is None or t > due[kind] + MARGIN_S for t in times)
    }
    assert late == {}, f"open past their bound (+{MARGIN_S} s): {late}"
    answers: dict[str, list[bytes]] = seen["answers"]  # type: ignore[assignment]
    assert all(answer == b"" for answer in answers["idle"] + answers["half head"])
    for answer in answers["half body"]:
        status, _, rest = answer.partition(b"\r\n")
        assert status == b"HTTP/1.1 408 Request Timeout", answer[:300]
        body = json.loads(rest.partition(b"\r\n\r\n")[2])
        assert body["error_type"] == "request_timeout", body
        assert f"{bounds.body_s:g} s" in body["error"], body


def test_the_worker_closes_connections_that_keep_it_waiting(worker: ManagedProcess) -> None:
    check(worker.url, "/v1/completions", "key-team-a", ConnectionBounds())


def test_the_gateway_closes_connections_that_keep_it_waiting(gateway: ManagedProcess) -> None:
    check(gateway.url, "/v1/completions", "key-team-a", SHORT)


def test_the_trainer_closes_connections_that_keep_it_waiting(trainer: ManagedProcess) -> None:
    check(trainer.url, "/api/v1/create_model", TRAINER_KEY, SHORT)


def test_past_its_connection_limit_a_service_answers_503_until_idle_ones_are_closed(
    gateway: ManagedProcess,
) -> None:
    address = urlsplit(gateway.url)
    idle = [
        socket.create_connection((address.hostname, address.port)) for _ in range(SHORT.connections)
    ]
    try:
        refused = httpx.get(f"{gateway.url}/health", timeout=10)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error_type"] == "over_capacity", refused.text
        assert f"limit of {SHORT.connections} connections" in refused.json()["error"]
        assert refused.headers["Retry-After"] == "1"
        answers = [refused]  # asked again as Retry-After says, until the idle ones are closed
        while answers[-1].status_code == 503 and len(answers) <= OVER_CAPACITY_TRIES:
            time.sleep(float(answers[-1].headers.get("Retry-After", "1")))
            answers.append(httpx.get(f"{gateway.url}/health", timeout=10))
        assert answers[-1].status_code == 200, [(a.status_code, a.text) for a in answers]
    finally:
        for s in idle:
            s.close()
