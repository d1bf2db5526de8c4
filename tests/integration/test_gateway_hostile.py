"""Hostile input at the gateway, hand-made, one row per class of what issue 34 found: each
answers 4xx in the error table's JSON shape naming the field (or value) at fault, never 5xx,
and echoes no more than a short prefix of what was sent. Unknown routes and methods answer in
the same shape; the gateway describes what it forwards (`/openapi.json`); and a client that
goes away mid-body is at most one line in the gateway's log, no traceback.

A real gateway process in front of the session's worker, over HTTP on loopback. And a worker
that stops answering (SIGSTOP: its kernel still takes connections and bytes, as a host cut off
takes nothing, and neither resets) with a request on it: that request ends with a 502 within a
refresh of the gateway's plus two seconds, the next goes to the other worker, and once the
stopped one answers again it gets its share back."""

import dataclasses
import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
import pytest

from mint_core.config import MintConfig
from processes import ManagedProcess
from serving.gateway import WORKER_HEADER, start_gateway
from serving.http.errors import MESSAGE_LIMIT
from serving.http.limits import MAX_REQUEST_BYTES
from tests.integration.helpers import error_of

pytestmark = pytest.mark.slow

HUGE = "9" * 4301
"""A revision number past Python's int-string limit (4,300 digits)."""
LONG_NAME = "a" * 10_000
DISCONNECTS = 20


@pytest.fixture(scope="module")
def gateway(fleet_config: MintConfig) -> Iterator[ManagedProcess]:
    process = start_gateway(fleet_config)
    yield process
    process.stop()


@dataclass(frozen=True)
class Hostile:
    """One hand-made request and what it must answer."""

    path: str
    body: bytes | None
    status: int
    error_type: str
    names: str
    """What the error message must name: the field, or the value's start."""
    method: str = "POST"
    key: str = ""
    """The API key sent, if any."""


def tgi(parameters: object) -> bytes:
    return json.dumps({"inputs": "hello", "parameters": parameters}).encode()


def chat(model: object) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]}).encode()


CASES = {
    "parameters a string": Hostile("/", tgi("AAA"), 422, "validation", "parameters"),
    "parameters a list": Hostile("/generate", tgi([1, 2]), 422, "validation", "parameters"),
    "parameters a bool": Hostile("/generate_stream", tgi(True), 422, "validation", "parameters"),
    "adapter_id a number": Hostile(
        "/generate", tgi({"adapter_id": 5}), 422, "validation", "parameters.adapter_id"
    ),
    "model a list": Hostile("/v1/chat/completions", chat(["a"]), 422, "validation", "model"),
    "body a list": Hostile("/generate", b"[1, 2]", 422, "validation", "body"),
    "body not JSON": Hostile("/v1/completions", b"{inputs", 422, "validation", "not JSON"),
    "body nested past any depth": Hostile("/", b"[" * 5000, 422, "validation", "not JSON"),
    "a lone surrogate": Hostile(
        "/v1/chat/completions", chat("\ud800"), 422, "validation", "surrogate"
    ),
    "revision past int64": Hostile(
        "/generate",
        tgi({"adapter_id": "fz-bot:r9223372036854775808"}),
        422,
        "validation",
        "r9223372036854775808",
    ),
    "revision past the int-string limit": Hostile(
        "/v1/completions",
        json.dumps({"model": f"fz-bot:r{HUGE}", "prompt": "hi"}).encode(),
        422,
        "validation",
        "fz-bot:r999",
    ),
    "revision past int64 in the URL": Hostile(
        "/adapters/fz-bot:r9223372036854775808/generate",
        tgi({}),
        422,
        "validation",
        "r9223372036854775808",
    ),
    "a 10,000-character name": Hostile(
        "/v1/chat/completions", chat(LONG_NAME), 422, "validation", "aaaa"
    ),
    "an unknown adapter": Hostile(
        "/v1/chat/completions", chat("no-such-bot"), 404, "not_found", "no-such-bot"
    ),
    "an unknown route": Hostile("/no/such/route", None, 404, "not_found", "/no/such/route", "GET"),
    "an unknown method": Hostile("/generate", None, 405, "method_not_allowed", "POST", "GET"),
    "an unknown key": Hostile(
        "/v1/models", None, 401, "unauthenticated", "API key", "GET", key="no-such-key"
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_hostile_requests_answer_4xx_naming_the_field(
    gateway: ManagedProcess, case: Hostile
) -> None:
    response = httpx.request(
        case.method,
        gateway.url + case.path,
        content=case.body,
        headers={"content-type": "application/json"}
        | ({"authorization": f"Bearer {case.key}"} if case.key else {}),
        timeout=60,
    )
    message = error_of(response, case.status, case.error_type)
    assert case.names in message
    assert len(message) <= MESSAGE_LIMIT + 1 and len(response.content) < 2 * MESSAGE_LIMIT


def test_a_405_says_which_methods_the_route_takes(gateway: ManagedProcess) -> None:
    assert httpx.get(gateway.url + "/generate").headers["allow"] == "POST"


def test_a_chunked_body_over_the_limit_answers_413(gateway: ManagedProcess) -> None:
    piece = b"x" * (64 << 10)
    pieces = [b'{"inputs": "', *[piece] * (MAX_REQUEST_BYTES // len(piece) + 1), b'"}']
    response = httpx.post(
        gateway.url + "/generate",
        content=iter(pieces),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert "this service's limit" in error_of(response, 413, "body_too_large")


def test_the_openapi_document_describes_the_bodies_it_forwards(gateway: ManagedProcess) -> None:
    document = httpx.get(gateway.url + "/openapi.json", timeout=30).json()
    generate = document["paths"]["/generate"]["post"]
    body = generate["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/GenerateRequest"}
    assert "parameters" in document["components"]["schemas"]["GenerateRequest"]["properties"]
    chat = document["paths"]["/adapters/{ref}/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ChatRequest"
    )
    assert set(document["paths"]["/health"]) == {"get"}
    assert "/admin/admit" not in document["paths"]  # the worker's, not forwarded


def test_clients_that_go_away_mid_body_are_one_log_line_each(gateway: ManagedProcess) -> None:
    """Each declares a body of 1,000 bytes, sends 10 and closes its connection."""
    before = gateway.log_tail(1 << 30)
    address = urlsplit(gateway.url)
    head = (
        f"POST /generate HTTP/1.1\r\nHost: {address.netloc}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    ).encode()
    for _ in range(DISCONNECTS):
        with socket.create_connection((address.hostname, address.port), timeout=10) as client:
            client.sendall(head + b'{"inputs":')
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the gateway notices each as it reads on
        logged = gateway.log_tail(1 << 30)[len(before) :]
        if logged.count("closed the connection") >= DISCONNECTS:
            break
        time.sleep(0.2)
    assert "Traceback" not in logged, logged[:2000]
    assert len(logged.splitlines()) <= DISCONNECTS, logged[:2000]


REFRESH_S = 0.5 + 2.0
"""How long the gateway takes to find a worker unreachable: its refresh interval, then the
poll's timeout (`serving.gateway.app`)."""


def generate_base(gateway: ManagedProcess) -> httpx.Response:
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 4}}
    return httpx.post(gateway.url + "/generate", json=body, timeout=60)


def workers_up(gateway: ManagedProcess) -> dict[str, bool]:
    health = httpx.get(gateway.url + "/health", timeout=10).json()
    return {w["url"]: w["up"] for w in health["workers"]}


def test_a_stopped_worker_ends_its_request_with_a_502_and_rejoins(
    fleet_config: MintConfig, s3_worker: ManagedProcess, worker: ManagedProcess
) -> None:
    """Two workers of one base (the S3 one reuses the session's, as the lifecycle tests do);
    base requests go to the first listed while both are idle, so it is the one stopped."""
    victim, survivor = s3_worker, worker
    config = dataclasses.replace(fleet_config, worker_urls=(victim.url, survivor.url))
    gateway = start_gateway(config)
    try:
        assert generate_base(gateway).headers[WORKER_HEADER] == victim.url
        os.killpg(victim.process.pid, signal.SIGSTOP)
        try:
            stopped_at = time.monotonic()
            ended = generate_base(gateway)  # sent to the victim before the gateway knows
            took = time.monotonic() - stopped_at
            message = error_of(ended, 502, "worker_unreachable")
            assert ended.headers[WORKER_HEADER] == victim.url and "send it again" in message
            assert took < REFRESH_S + 2, took
            after = [generate_base(gateway) for _ in range(3)]
            assert [(a.status_code, a.headers[WORKER_HEADER]) for a in after] == [
                (200, survivor.url)
            ] * 3
        finally:
            os.killpg(victim.process.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while not all(workers_up(gateway).values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(workers_up(gateway).values()), workers_up(gateway)
        assert generate_base(gateway).headers[WORKER_HEADER] == victim.url  # its share is back
    finally:
        gateway.stop()
