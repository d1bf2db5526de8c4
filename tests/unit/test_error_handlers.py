"""`install_error_handlers` on a plain Starlette app, as the gateway uses it: every error
answers in the table's JSON shape, a 500 names the log of the service that failed, and a
message echoing a lone surrogate can still be written."""

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.testclient import TestClient

from mint_core.errors import ConfigurationError
from serving.http.errors import install_error_handlers


def crash(_: Request) -> Response:
    raise RuntimeError("secret internals")


def refuse(_: Request) -> Response:
    raise ConfigurationError("adapter name '\ud800' is not valid")


@pytest.fixture
def client() -> TestClient:
    app = Starlette(routes=[Route("/crash", crash), Route("/refuse", refuse, methods=["POST"])])
    install_error_handlers(app, "gateway")
    return TestClient(app, raise_server_exceptions=False)


def test_a_500_names_the_log_of_the_service_that_failed(client: TestClient) -> None:
    response = client.get("/crash")
    assert response.status_code == 500
    assert response.json() == {
        "error": "GET /crash failed; the gateway's log has the details",
        "error_type": "internal",
    }


def test_a_lone_surrogate_in_a_message_is_written_as_its_escape(client: TestClient) -> None:
    response = client.post("/refuse")
    assert response.status_code == 422
    assert response.json()["error"] == "adapter name '\\ud800' is not valid"


@pytest.mark.parametrize(
    ("method", "path", "status", "error_type"),
    [("GET", "/nowhere", 404, "not_found"), ("GET", "/refuse", 405, "method_not_allowed")],
)
def test_unknown_routes_and_methods_answer_json(
    client: TestClient, method: str, path: str, status: int, error_type: str
) -> None:
    response = client.request(method, path)
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error_type"] == error_type
    assert path in response.json()["error"]
