"""Hostile input at the gateway: schemathesis reads the gateway's OpenAPI document (its
workers' for the routes it forwards), generates requests for each operation (valid ones,
boundary values, wrong types, missing fields, odd headers) and sends them over HTTP to a real
gateway process in front of the session's worker. No answer may be a server error (5xx) and
none may take longer than RESPONSE_BOUND_S.

Bounded and derandomized as the worker's lane (`test_fuzz`), to fit about a minute."""

from collections.abc import Iterator

import pytest
import schemathesis
from schemathesis.checks import max_response_time, not_a_server_error

from control.services import ManagedProcess
from mint_core.config import MintConfig
from serving.gateway import start_gateway

pytestmark = pytest.mark.slow

MAX_EXAMPLES = 25
"""Generated requests per operation, besides schemathesis's boundary and negative cases."""
RESPONSE_BOUND_S = 20.0
"""Longest answer allowed: a generation the tiny base's context allows takes a few seconds on a
busy CPU; the gateway adds a hop."""
REQUEST_TIMEOUT_S = 2 * RESPONSE_BOUND_S
"""When the client gives up on an answer (a hang fails the test instead of blocking it)."""


@pytest.fixture(scope="module")
def fuzz_gateway(fleet_config: MintConfig) -> Iterator[ManagedProcess]:
    process = start_gateway(fleet_config)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def gateway_schema(fuzz_gateway: ManagedProcess) -> schemathesis.BaseSchema:
    schema = schemathesis.openapi.from_url(f"{fuzz_gateway.url}/openapi.json")
    schema.config.update(base_url=fuzz_gateway.url)
    # No example database: it would be written into the working tree.
    schema.config.generation.update(max_examples=MAX_EXAMPLES, deterministic=True, database="none")
    schema.config.checks.update(max_response_time=RESPONSE_BOUND_S)
    return schema


@pytest.fixture(autouse=True)
def node_id_for_schemathesis(request: pytest.FixtureRequest) -> None:
    """schemathesis 4.32 reads and writes `node._nodeid`, which pytest 9.2 no longer has (the
    id moved to `node._id`): give it one, which it renames per operation while it runs it."""
    request.node._nodeid = request.node.nodeid


schema = schemathesis.pytest.from_fixture("gateway_schema")


@schema.parametrize()
def test_no_request_gets_a_server_error_or_hangs(case: schemathesis.Case) -> None:
    case.call_and_validate(
        checks=[not_a_server_error, max_response_time], timeout=REQUEST_TIMEOUT_S
    )
