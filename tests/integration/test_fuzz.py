"""Hostile input at the worker's HTTP API: schemathesis reads the worker's own OpenAPI schema
(`/openapi.json`), generates requests for every operation (valid ones, boundary values, wrong
types, missing fields, odd headers) and sends them over HTTP to a real worker process on
loopback. No answer may be a server error (5xx) and none may take longer than RESPONSE_BOUND_S
(a hang, or work a request should have been refused before starting).

The run is bounded (MAX_EXAMPLES per operation, derandomized so that a failure comes back
the same way) to fit about a minute on two busy cores.

Backends: `fuzz_worker_url` is a worker of each backend. The embedded one has no API keys, so
that every endpoint is reachable; the vLLM one is the backend contract's (`mixed_fleet`, with
keys: the admin endpoints answer 401 there, generation on the base is open to anyone), which
saves starting vLLM once more."""

import dataclasses
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from schemathesis.checks import max_response_time, not_a_server_error

from mint_core.config import BackendKind, MintConfig
from serving.http.limits import MAX_REQUEST_BYTES
from serving.worker.server import start_worker
from tests.integration.helpers import MixedFleet

pytestmark = pytest.mark.slow

MAX_EXAMPLES = 25
"""Generated requests per operation, besides schemathesis's boundary and negative cases."""
RESPONSE_BOUND_S = 20.0
"""Longest answer allowed: the longest generation the context allows (127 tokens of the tiny
base) takes a few seconds on a busy CPU."""
REQUEST_TIMEOUT_S = 2 * RESPONSE_BOUND_S
"""When the client gives up on an answer (a hang fails the test instead of blocking it)."""


@pytest.fixture(scope="module", params=[BackendKind.EMBEDDED, BackendKind.VLLM])
def fuzz_worker_url(request: pytest.FixtureRequest, config: MintConfig) -> Iterator[str]:
    """A worker of the backend `request.param`, over the session's base."""
    if request.param is BackendKind.VLLM:
        fleet: MixedFleet = request.getfixturevalue("mixed_fleet")
        yield fleet.workers[BackendKind.VLLM].url
        return
    worker_config = dataclasses.replace(config, api_keys={}, backend=request.param)
    process = start_worker(worker_config)
    yield process.url
    process.stop()


@pytest.fixture(scope="module")
def worker_schema(fuzz_worker_url: str) -> schemathesis.BaseSchema:
    schema = schemathesis.openapi.from_url(f"{fuzz_worker_url}/openapi.json")
    schema.config.update(base_url=fuzz_worker_url)
    # No example database: it would be written into the working tree.
    schema.config.generation.update(max_examples=MAX_EXAMPLES, deterministic=True, database="none")
    schema.config.checks.update(max_response_time=RESPONSE_BOUND_S)
    return schema


@pytest.fixture(autouse=True)
def node_id_for_schemathesis(request: pytest.FixtureRequest) -> None:
    """schemathesis 4.32 reads and writes `node._nodeid`, which pytest 9.2 no longer has (the
    id moved to `node._id`): give it one, which it renames per operation while it runs it."""
    request.node._nodeid = request.node.nodeid


schema = schemathesis.pytest.from_fixture("worker_schema")


@schema.parametrize()
def test_no_request_gets_a_server_error_or_hangs(case: schemathesis.Case) -> None:
    case.call_and_validate(
        checks=[not_a_server_error, max_response_time], timeout=REQUEST_TIMEOUT_S
    )


def test_a_chunked_body_over_the_limit_answers_413(fuzz_worker_url: str) -> None:
    """Sent without Content-Length, a body is counted as it arrives: it cannot pass the limit
    by not declaring its size."""
    piece = b"x" * (64 << 10)
    pieces = [b'{"inputs": "', *[piece] * (MAX_REQUEST_BYTES // len(piece) + 1), b'"}']
    response = httpx.post(
        f"{fuzz_worker_url}/generate",
        content=iter(pieces),
        headers={"content-type": "application/json"},
        timeout=REQUEST_TIMEOUT_S,
    )
    assert "content-length" not in response.request.headers
    assert response.status_code == 413, response.text
    assert response.json()["error_type"] == "body_too_large"
