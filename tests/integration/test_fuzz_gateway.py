"""Hostile input at the gateway: schemathesis reads the gateway's OpenAPI document (its
workers' for the routes it forwards), generates requests for each operation (valid ones,
boundary values, wrong types, missing fields, odd headers) and sends them over HTTP to a real
gateway process in front of the session's worker. No answer may be a server error (5xx) and
none may take longer than FUZZ_RESPONSE_BOUND_S (tests.integration.helpers).

Bounded and derandomized as the worker's lane (`test_fuzz`), to fit about a minute."""

from collections.abc import Iterator

import pytest
import schemathesis
from schemathesis.checks import max_response_time, not_a_server_error

from mint_core.config import MintConfig
from processes import ManagedProcess
from serving.gateway import start_gateway
from tests.integration.helpers import FUZZ_TIMEOUT_S, openapi_lane

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("schemathesis_node_id")]


@pytest.fixture(scope="module")
def fuzz_gateway(fleet_config: MintConfig) -> Iterator[ManagedProcess]:
    process = start_gateway(fleet_config)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def gateway_schema(fuzz_gateway: ManagedProcess) -> schemathesis.BaseSchema:
    return openapi_lane(fuzz_gateway.url)


schema = schemathesis.pytest.from_fixture("gateway_schema")


@schema.parametrize()
def test_no_request_gets_a_server_error_or_hangs(case: schemathesis.Case) -> None:
    case.call_and_validate(checks=[not_a_server_error, max_response_time], timeout=FUZZ_TIMEOUT_S)
