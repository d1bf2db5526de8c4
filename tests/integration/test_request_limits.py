"""The limits on hostile input, over a real worker in this process: a body over the size limit
answers 413, new tokens the context cannot hold and out-of-range values 422, each naming the
limit (the protocols' translations themselves are tests/unit/test_protocols.py)."""

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from processes import ManagedProcess
from serving.http.app import create_app
from serving.http.limits import MAX_REQUEST_BYTES
from serving.protocols import openai
from serving.worker.worker import Worker
from tests.integration.helpers import app_client, error_of, in_process_worker

CONTEXT = 128
"""The context length of the in-process worker's base."""
FITS = f"({CONTEXT} tokens, the prompt's included); ask for at most {CONTEXT - 1}"
"""How a refusal of new tokens that cannot fit the context ends."""
CHAT = [{"role": "user", "content": "a="}]


@pytest.fixture(scope="module")
def local_worker(
    mlflow_server: ManagedProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Worker]:
    with in_process_worker(mlflow_server, tmp_path_factory.mktemp("protocols")) as worker:
        yield worker


@pytest.fixture(scope="module")
def api(local_worker: Worker) -> Iterator[TestClient]:
    with app_client(local_worker) as client:
        yield client


@pytest.mark.parametrize(
    ("path", "body", "named"),
    [
        (
            "/generate",
            {"inputs": "a=", "parameters": {"max_new_tokens": 10**9}},
            ("max_new_tokens=", FITS),
        ),
        (
            "/",
            {"inputs": "a=", "parameters": {"max_new_tokens": 128}},
            ("max_new_tokens=128", FITS),
        ),
        (
            "/v1/completions",
            {"model": "base", "prompt": "a=", "max_tokens": 500},
            ("max_tokens=500", FITS),
        ),
        (
            "/v1/chat/completions",
            {"model": "base", "messages": CHAT, "max_completion_tokens": 128},
            ("max_completion_tokens=128", FITS),
        ),
        (
            "/v1/completions",
            {"model": "base", "prompt": ["a="] * (openai.MAX_PROMPTS + 1)},
            (f"send at most {openai.MAX_PROMPTS} (MAX_PROMPTS)",),
        ),
    ],
)
def test_what_no_prompt_can_make_fit_answers_422_before_tokenizing(
    api: TestClient,
    local_worker: Worker,
    monkeypatch: pytest.MonkeyPatch,
    path: str,
    body: dict[str, object],
    named: tuple[str, ...],
) -> None:
    def refuse(*_: object) -> list[int]:
        raise AssertionError("the prompt was tokenized")

    assert local_worker.base.context_length == CONTEXT
    monkeypatch.setattr(local_worker.codec, "encode", refuse)
    monkeypatch.setattr(local_worker.codec, "encode_chat", refuse)
    message = error_of(api.post(path, json=body), 422, "validation")
    for part in named:
        assert part in message


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/generate", {"inputs": "a=", "parameters": {"seed": 2**64}}, "parameters.seed"),
        ("/v1/completions", {"model": "base", "prompt": "a=", "seed": -(2**63) - 1}, "seed"),
    ],
)
def test_values_out_of_range_answer_422_naming_the_bound(
    api: TestClient,
    path: str,
    body: dict[str, object],
    field: str,
) -> None:
    # A seed the generator cannot take was a 500 (ValueError from torch) before it had bounds.
    message = error_of(api.post(path, json=body), 422, "validation")
    assert message.startswith(f"{field}: ")
    assert any(bound in message for bound in (str(2**64 - 1), str(-(2**63))))


def test_a_body_over_the_limit_answers_413_declared_or_not(api: TestClient) -> None:
    prompt = "x" * MAX_REQUEST_BYTES
    chat = {"model": "base", "messages": [{"role": "user", "content": prompt}]}
    for path, body in [("/generate", {"inputs": prompt}), ("/v1/chat/completions", chat)]:
        content = json.dumps(body).encode()
        declared = api.post(path, content=content, headers={"content-type": "application/json"})
        message = error_of(declared, 413, "body_too_large")
        assert f"limit of {MAX_REQUEST_BYTES} bytes (max_request_bytes)" in message
        # Chunked, without Content-Length: counted as it arrives.
        chunked = api.post(
            path, content=iter([content[:1000], content[1000:]]),
            headers={"content-type": "application/json"},
        )  # fmt: skip
        assert "content-length" not in chunked.request.headers
        assert error_of(chunked, 413, "body_too_large") == message


def test_the_body_limit_is_the_apps_to_set(local_worker: Worker) -> None:
    with TestClient(create_app(local_worker, max_request_bytes=100)) as small:
        fits = {"inputs": "a=", "parameters": {"max_new_tokens": 2}}
        assert len(json.dumps(fits)) <= 100
        assert small.post("/generate", json=fits).status_code == 200
        over = {"inputs": "a=" * 50, "parameters": {"max_new_tokens": 2}}
        refused = small.post("/generate", json=over)
        assert "limit of 100 bytes" in error_of(refused, 413, "body_too_large")
