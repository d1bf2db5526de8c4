"""Hostile input at the worker's HTTP API: schemathesis reads the worker's own OpenAPI schema
(`/openapi.json`), generates requests for every operation (valid ones, boundary values, wrong
types, missing fields, odd headers) and sends them over HTTP to a real worker process on
loopback. No answer may be a server error (5xx) and none may take longer than
FUZZ_RESPONSE_BOUND_S (a hang, or work a request should have been refused before starting).

The run is bounded (FUZZ_EXAMPLES per operation, derandomized so that a failure comes back
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
from tests.integration.helpers import FUZZ_TIMEOUT_S, MixedFleet, openapi_lane

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("schemathesis_node_id")]


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
    return openapi_lane(fuzz_worker_url)


schema = schemathesis.pytest.from_fixture("worker_schema")


@schema.parametrize()
def test_no_request_gets_a_server_error_or_hangs(case: schemathesis.Case) -> None:
    case.call_and_validate(checks=[not_a_server_error, max_response_time], timeout=FUZZ_TIMEOUT_S)


def test_a_chunked_body_over_the_limit_answers_413(fuzz_worker_url: str) -> None:
    """Sent without Content-Length, a body is counted as it arrives: it cannot pass the limit
    by not declaring its size."""
    piece = b"x" * (64 << 10)
    pieces = [b'{"inputs": "', *[piece] * (MAX_REQUEST_BYTES // len(piece) + 1), b'"}']
    response = httpx.post(
        f"{fuzz_worker_url}/generate",
        content=iter(pieces),
        headers={"content-type": "application/json"},
        timeout=FUZZ_TIMEOUT_S,
    )
    assert "content-length" not in response.request.headers
    assert response.status_code == 413, response.text
    assert response.json()["error_type"] == "body_too_large"
