"""Every error the worker's HTTP API answers has one JSON shape, `{"error", "error_type"}` (plus
the names that explain it), with the README's status codes, inside streams too; echoed values
are cut short; no answer or stream event carries NaN or Infinity, which JSON does not have.

The app runs in this process over a real worker (a tiny random base, the session's MLflow).
Where a test needs the engine to produce something it never would on purpose (a NaN logprob,
a failure in the middle of a stream), the worker hands the app a scheduler request driven by
the test instead of the engine."""

import logging
import math
import re
from collections.abc import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient

from mint_core.errors import ECHO_LIMIT, ServiceError
from processes import ManagedProcess
from serving.engine.engine import BASE
from serving.engine.generation import Generating, TokenEvent
from serving.engine.sampling import SamplingParams
from serving.http.client import WorkerClient
from serving.worker.worker import Worker
from tests.integration.helpers import app_client, error_of, in_process_worker, strict_json

LONG = 10_000
"""Length of the values sent to see how much of them comes back."""
CHAT = [{"role": "user", "content": "a="}]


@pytest.fixture(scope="module")
def local_worker(
    mlflow_server: ManagedProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Worker]:
    with in_process_worker(mlflow_server, tmp_path_factory.mktemp("api-errors")) as worker:
        yield worker


@pytest.fixture(scope="module")
def api(local_worker: Worker) -> Iterator[TestClient]:
    with app_client(local_worker) as client:
        yield client


def sse_events(response: httpx.Response) -> list[dict[str, object]]:
    lines = response.text.splitlines()
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    return [strict_json(text) for text in data if text != "[DONE]"]


def token_a(worker: Worker) -> int:
    """The base's token for the text "A"."""
    (token,) = worker.backend.engine.codec.tokenizer("A", add_special_tokens=False)["input_ids"]
    return token


def driven(
    worker: Worker, events: list[tuple[int, float] | ServiceError], max_new_tokens: int
) -> Generating:
    """A scheduler request whose tokens and log-probabilities (or failure) the test decides."""
    request = Generating([0], BASE, SamplingParams(max_new_tokens), worker.backend.engine.codec)
    for event in events:
        if isinstance(event, ServiceError):
            request.fail(event)
        else:
            request.push(*event)
    return request


def serve_next(monkeypatch: pytest.MonkeyPatch, worker: Worker, request: Generating) -> None:
    monkeypatch.setattr(worker, "generate", lambda prompt, key, params, **_: request)


@pytest.mark.parametrize(
    ("path", "body", "field", "value"),
    [
        ("/generate", {"inputs": "a=", "parameters": {"top_p": 1.5}}, "parameters.top_p", "1.5"),
        ("/generate", {"inputs": "a=", "parameters": {"max_new_tokens": 0}}, "max_new_tokens", "0"),
        ("/generate", {"parameters": {}}, "inputs", "required"),
        ("/generate_stream", {"inputs": 7}, "inputs", "7"),
        (
            "/v1/completions",
            {"model": "base", "prompt": "a=", "temperature": 3},
            "temperature",
            "3",
        ),
        ("/v1/chat/completions", {"model": "base", "messages": []}, "messages", "[]"),
        ("/admin/admit", {"adapter": "some-bot", "revision": 0}, "revision", "0"),
    ],
)
def test_a_field_out_of_range_answers_422_naming_the_field_and_value(
    api: TestClient, path: str, body: object, field: str, value: str
) -> None:
    message = error_of(api.post(path, json=body), 422, "validation")
    assert field in message
    assert value in message


@pytest.mark.parametrize(
    ("content", "named"),
    [
        (b'{"inputs": "abc=", ', "JSON"),
        (b'{"inputs": "\xff\xfe="}', "UTF-8"),
        (b"\xff\xfe", "UTF-8"),
    ],
)
@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_a_body_that_is_not_json_answers_422(
    api: TestClient, path: str, content: bytes, named: str
) -> None:
    response = api.post(path, content=content, headers={"content-type": "application/json"})
    assert named in error_of(response, 422, "validation")


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/generate", {"inputs": "a=", "parameters": {"adapter_id": "x" * LONG}}),
        ("POST", "/v1/completions", {"model": "x" * LONG, "prompt": "a="}),
        ("GET", "/v1/adapters/" + "x" * LONG, None),
        ("POST", "/generate", {"inputs": "a=", "parameters": {"top_p": "x" * LONG}}),
        ("POST", "/admin/admit", {"adapter": "x" * LONG, "revision": 1}),
    ],
)
def test_a_long_value_is_echoed_cut_short(
    api: TestClient, method: str, path: str, body: object
) -> None:
    message = error_of(api.request(method, path, json=body), 422, "validation")
    (echoed,) = re.findall("x{100,}…?", message)
    assert echoed.endswith("…")
    assert ECHO_LIMIT - 2 <= len(echoed) - 1 <= ECHO_LIMIT  # less its quotes, when quoted


def test_a_long_value_with_spaces_is_cut_short_too(api: TestClient) -> None:
    response = api.post("/generate", json={"inputs": "a=", "parameters": {"top_p": "x " * LONG}})
    message = error_of(response, 422, "validation")
    assert "top_p" in message
    assert len(response.content) < 3 * ECHO_LIMIT


def test_an_unknown_adapter_answers_404(api: TestClient) -> None:
    assert "nobody-bot" in error_of(api.get("/v1/adapters/nobody-bot"), 404, "not_found")
    body = {"inputs": "a=", "parameters": {"adapter_id": "nobody-bot"}}
    assert "nobody-bot" in error_of(api.post("/generate", json=body), 404, "not_found")


def test_unknown_routes_and_methods_answer_in_the_same_shape(api: TestClient) -> None:
    assert "/no-such-route" in error_of(api.get("/no-such-route"), 404, "not_found")
    wrong_method = api.get("/generate")
    assert "GET" in error_of(wrong_method, 405, "method_not_allowed")
    assert wrong_method.headers["Allow"] == "POST"


def test_an_unexpected_failure_answers_500_without_its_details(
    api: TestClient, local_worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash() -> list[object]:
        raise RuntimeError("secret internals")

    monkeypatch.setattr(local_worker, "events", crash)
    response = api.get("/admin/events")
    message = error_of(response, 500, "internal")
    assert "worker's log" in message
    assert "secret" not in response.text and "Traceback" not in response.text


def test_without_api_keys_admin_endpoints_are_open(api: TestClient) -> None:
    assert api.get("/admin/events").status_code == 200
    assert api.get("/admin/events", headers={"Authorization": "Bearer any"}).status_code == 200


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate_stream", {"inputs": "a="}),
        ("/", {"inputs": "a=", "stream": True}),
        ("/v1/completions", {"model": "base", "prompt": "a=", "stream": True}),
        ("/v1/chat/completions", {"model": "base", "messages": CHAT, "stream": True}),
    ],
)
def test_an_error_inside_a_stream_is_one_last_event_in_the_same_shape(
    api: TestClient, local_worker: Worker, monkeypatch: pytest.MonkeyPatch, path: str, body: object
) -> None:
    failure = ServiceError("the engine failed a step: RuntimeError: boom")
    tokens: list[tuple[int, float] | ServiceError] = [(token_a(local_worker), -0.5)] * 2
    serve_next(monkeypatch, local_worker, driven(local_worker, [*tokens, failure], 4))
    streamed = api.post(path, json=body)
    assert streamed.status_code == 200
    *sent, last = sse_events(streamed)
    assert sent, "the tokens before the failure were streamed"
    serve_next(monkeypatch, local_worker, driven(local_worker, [*tokens, failure], 4))
    answered = api.post("/generate", json={"inputs": "a="})
    assert error_of(answered, 503, "service") == str(failure)
    assert last == answered.json()


def test_an_unexpected_failure_inside_a_stream_is_logged_not_sent(
    api: TestClient,
    local_worker: Worker,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Crashing(Generating):
        def events(self, timeout_s: float | None = None) -> Iterator[TokenEvent]:
            yield from [TokenEvent(token_a(local_worker), "A", -0.5)] * 2
            raise RuntimeError("secret internals")

    request = Crashing([0], BASE, SamplingParams(4), local_worker.backend.engine.codec)
    serve_next(monkeypatch, local_worker, request)
    with caplog.at_level(logging.ERROR, logger="serving.http.context"):
        streamed = api.post("/generate_stream", json={"inputs": "a="})
    *_, last = sse_events(streamed)
    assert last["error_type"] == "internal" and set(last) == {"error", "error_type"}
    assert "secret" not in streamed.text
    assert any(
        record.exc_info and "secret internals" in str(record.exc_info[1])
        for record in caplog.records
    )


def test_non_finite_logprobs_are_sent_as_null(
    api: TestClient, local_worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens: list[tuple[int, float] | ServiceError] = [
        (token_a(local_worker), logprob) for logprob in (math.nan, -math.inf, -0.5)
    ]
    serve_next(monkeypatch, local_worker, driven(local_worker, tokens, max_new_tokens=3))
    details = {"inputs": "a=", "parameters": {"details": True}}
    answered = api.post("/generate", json=details)
    assert answered.status_code == 200, answered.text
    sent = strict_json(answered.text)["details"]["tokens"]  # type: ignore[index]
    assert [token["logprob"] for token in sent] == [None, None, -0.5]

    serve_next(monkeypatch, local_worker, driven(local_worker, tokens, max_new_tokens=3))
    streamed = api.post("/generate_stream", json=details)
    assert [event["token"]["logprob"] for event in sse_events(streamed)] == [None, None, -0.5]  # type: ignore[index]


@pytest.mark.slow
def test_a_refused_pipeline_key_names_the_setting_to_change(worker: ManagedProcess) -> None:
    client = WorkerClient(worker.url, "key-team-a")
    with pytest.raises(ServiceError, match=r"403 principal 'team-a' is not an admin.*MINT_WORKER"):
        client.sync()
    client.close()
