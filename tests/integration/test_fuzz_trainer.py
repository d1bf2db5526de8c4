"""Hostile input at the trainer's HTTP API (the Tinker API): schemathesis reads the trainer's
OpenAPI document (`/openapi.json`: every route's JSON body, and the protobuf body of
`forward_backward`), generates requests for each operation (valid ones, boundary values, wrong
types, missing fields) and sends them, with a tenant's API key, over HTTP to a real trainer
process on loopback. No answer may be a server error (5xx) and none may take longer than
FUZZ_RESPONSE_BOUND_S (a hang, or work a request should have been refused before starting).

Bounded and derandomized as the worker's lane (`test_fuzz`), to fit about a minute."""

import dataclasses
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from schemathesis.checks import max_response_time, not_a_server_error

from mint_core.config import MintConfig
from processes import ManagedProcess
from tests.integration.helpers import FUZZ_TIMEOUT_S, openapi_lane
from trainer.server import start_trainer
from trainer.wire import PROTOBUF

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("schemathesis_node_id")]

KEY = "tml-fuzz"


@pytest.fixture(scope="module")
def fuzz_trainer(config: MintConfig) -> Iterator[ManagedProcess]:
    process = start_trainer(dataclasses.replace(config, api_keys={KEY: "fuzz"}))
    yield process
    process.stop()


@pytest.fixture(scope="module")
def trainer_schema(fuzz_trainer: ManagedProcess) -> schemathesis.BaseSchema:
    return openapi_lane(fuzz_trainer.url)


# forward_backward's body is protobuf bytes: schemathesis sends what it generates for it as it
# sends any binary body.
schemathesis.serializer.alias(PROTOBUF, "application/octet-stream")
schema = schemathesis.pytest.from_fixture("trainer_schema")


@schema.parametrize()
def test_no_request_gets_a_server_error_or_hangs(case: schemathesis.Case) -> None:
    case.call_and_validate(
        headers={"X-API-Key": KEY},
        checks=[not_a_server_error, max_response_time],
        timeout=FUZZ_TIMEOUT_S,
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
