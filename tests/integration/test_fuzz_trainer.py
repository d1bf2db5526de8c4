"""Hostile input at the trainer's HTTP API (the Tinker API): schemathesis reads the trainer's
OpenAPI document (`/openapi.json`: every route's JSON body, and the protobuf body of
`forward_backward`), generates requests for each operation (valid ones, boundary values, wrong
types, missing fields) and sends them, with a tenant's API key, over HTTP to a real trainer
process on loopback. No answer may be a server error (5xx) and none may take longer than
RESPONSE_BOUND_S (a hang, or work a request should have been refused before starting).

Bounded and derandomized as the worker's lane (`test_fuzz`), to fit about a minute."""

import dataclasses
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from schemathesis.checks import max_response_time, not_a_server_error

from control.services import ManagedProcess
from mint_core.config import MintConfig
from trainer.server import start_trainer
from trainer.wire import PROTOBUF

pytestmark = pytest.mark.slow

KEY = "tml-fuzz"
MAX_EXAMPLES = 25
"""Generated requests per operation, besides schemathesis's boundary and negative cases."""
RESPONSE_BOUND_S = 20.0
"""Longest answer allowed: `retrieve_future` long-polls a few seconds at most, and nothing
else the trainer answers waits for work."""
REQUEST_TIMEOUT_S = 2 * RESPONSE_BOUND_S
"""When the client gives up on an answer (a hang fails the test instead of blocking it)."""


@pytest.fixture(scope="module")
def fuzz_trainer(config: MintConfig) -> Iterator[ManagedProcess]:
    process = start_trainer(dataclasses.replace(config, api_keys={KEY: "fuzz"}))
    yield process
    process.stop()


@pytest.fixture(scope="module")
def trainer_schema(fuzz_trainer: ManagedProcess) -> schemathesis.BaseSchema:
    schema = schemathesis.openapi.from_url(f"{fuzz_trainer.url}/openapi.json")
    schema.config.update(base_url=fuzz_trainer.url)
    # No example database: it would be written into the working tree.
    schema.config.generation.update(max_examples=MAX_EXAMPLES, deterministic=True, database="none")
    schema.config.checks.update(max_response_time=RESPONSE_BOUND_S)
    return schema


@pytest.fixture(autouse=True)
def node_id_for_schemathesis(request: pytest.FixtureRequest) -> None:
    """schemathesis 4.32 reads and writes `node._nodeid`, which pytest 9.2 no longer has (the
    id moved to `node._id`): give it one, which it renames per operation while it runs it."""
    request.node._nodeid = request.node.nodeid


# forward_backward's body is protobuf bytes: schemathesis sends what it generates for it as it
# sends any binary body.
schemathesis.serializer.alias(PROTOBUF, "application/octet-stream")
schema = schemathesis.pytest.from_fixture("trainer_schema")


@schema.parametrize()
def test_no_request_gets_a_server_error_or_hangs(case: schemathesis.Case) -> None:
    case.call_and_validate(
        headers={"X-API-Key": KEY},
        checks=[not_a_server_error, max_response_time],
        timeout=REQUEST_TIMEOUT_S,
    )


def test_the_document_describes_every_request_body(fuzz_trainer: ManagedProcess) -> None:
    """Every POST route says what body it takes: JSON, or forward_backward's protobuf."""
    paths = httpx.get(f"{fuzz_trainer.url}/openapi.json").json()["paths"]
    posts = {path: ops["post"] for path, ops in paths.items() if "post" in ops}
    assert len(posts) >= 16, sorted(posts)
    described = {
        path: sorted(op["requestBody"]["content"])
        for path, op in posts.items()
        if "requestBody" in op
    }
    bodiless = {"/api/v1/client/config", "/api/v1/client/dynamic_config"}
    assert set(posts) - set(described) == bodiless, sorted(set(posts) - set(described))
    assert described["/api/v1/forward_backward"] == [PROTOBUF]
    assert described["/api/v1/create_model"] == ["application/json"]


def test_the_lane_reached_every_route(fuzz_trainer: ManagedProcess) -> None:
    """Runs last in this module: the requests the lane sent, per route (`/health` counts them),
    every route among them."""
    calls = httpx.get(f"{fuzz_trainer.url}/health").json()["calls"]
    print(f"schemathesis sent {sum(calls.values())} requests: {calls}")
    paths = httpx.get(f"{fuzz_trainer.url}/openapi.json").json()["paths"]
    routes = {path.removeprefix("/api/v1/") for path in paths if path.startswith("/api/v1/")}
    assert routes - calls.keys() == set(), calls
