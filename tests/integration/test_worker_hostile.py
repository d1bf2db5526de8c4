"""Hostile input to the worker (issue 34): values that once failed inside it (500) answer 4xx
in the error shape, naming the field or the value, cut short. One row per class, over a real
worker in this process (its registry a real `mlflow server`)."""

import json
from collections.abc import Iterator
from urllib.parse import quote

import httpx
import pytest
from fastapi.testclient import TestClient

from control.services import ManagedProcess
from serving.http.errors import ECHO_LIMIT
from tests.integration.helpers import app_client, error_of, in_process_worker

SURROGATE = "\ud800"
"""A lone surrogate, as JSON's `"\\ud800"` decodes: no character UTF-8 (or a tokenizer) has."""
NOT_UNICODE = "not valid Unicode (a lone surrogate)"
HUGE = "fz-bot:r9223372036854775808"
"""One past the registry's int64: it overflowed SQLite."""
TOO_LARGE = "larger than any revision can be"
LONG = "fz-bot:r" + "1" * 4301
"""Past Python's limit on converting digit strings."""
CHAT = [{"role": "user", "content": "a="}]
TGI_ROUTES = ("/", "/generate", "/generate_stream")


def tgi(inputs: str = "a=", **parameters: object) -> dict[str, object]:
    return {"inputs": inputs, "parameters": {"max_new_tokens": 2, **parameters}}


def completion(prompt: object = "a=", **fields: object) -> dict[str, object]:
    return {"model": "base", "prompt": prompt, "max_tokens": 2, **fields}


def chat(messages: object = CHAT, **fields: object) -> dict[str, object]:
    return {"model": "base", "messages": messages, "max_tokens": 2, **fields}


CASES: list[tuple[str, str, dict[str, object], int, str, tuple[str, ...]]] = [
    # id, path, body, status, error_type, what the message names
    *[
        (f"surrogate-inputs{path}", path, tgi("a" + SURROGATE), 422, "validation", ("inputs",))
        for path in TGI_ROUTES
    ],
    (
        "surrogate-inputs-stream",
        "/",
        {**tgi(SURROGATE), "stream": True},
        422,
        "validation",
        ("inputs",),
    ),
    ("surrogate-stop", "/generate", tgi(stop=["x" + SURROGATE]), 422, "validation", ("stop",)),
    ("surrogate-prompt", "/v1/completions", completion(SURROGATE), 422, "validation", ("prompt",)),
    (
        "surrogate-prompt-list",
        "/v1/completions",
        completion(["a=", SURROGATE]),
        422,
        "validation",
        ("prompt", "item 1"),
    ),
    (
        "surrogate-prompt-stream",
        "/v1/completions",
        completion(SURROGATE, stream=True),
        422,
        "validation",
        ("prompt",),
    ),
    (
        "surrogate-completion-stop",
        "/v1/completions",
        completion(stop=SURROGATE),
        422,
        "validation",
        ("stop",),
    ),
    (
        "surrogate-content",
        "/v1/chat/completions",
        chat([{"role": "user", "content": "hi" + SURROGATE}]),
        422,
        "validation",
        ("messages.0.content",),
    ),
    (
        "surrogate-role",
        "/v1/chat/completions",
        chat([{"role": "user" + SURROGATE, "content": "hi"}]),
        422,
        "validation",
        ("messages.0.role",),
    ),
    (
        "surrogate-content-stream",
        "/v1/chat/completions",
        chat([{"role": "user", "content": SURROGATE}], stream=True),
        422,
        "validation",
        ("messages.0.content",),
    ),
    (
        "surrogate-adapter-url",
        "/adapters/fz-bot/generate",
        tgi(SURROGATE),
        422,
        "validation",
        ("inputs",),
    ),
    ("huge-revision-tgi", "/generate", tgi(adapter_id=HUGE), 422, "validation", (HUGE, TOO_LARGE)),
    (
        "huge-revision-openai",
        "/v1/chat/completions",
        {**chat(), "model": HUGE},
        422,
        "validation",
        (HUGE, TOO_LARGE),
    ),
    ("huge-revision-url", f"/adapters/{HUGE}/generate", tgi(), 422, "validation", (HUGE,)),
    (
        "huge-revision-admit",
        "/admin/admit",
        {"adapter": "fz-bot", "revision": 2**63},
        422,
        "validation",
        ("revision",),
    ),
    ("long-revision", "/v1/completions", completion(model=LONG), 422, "validation", (LONG[:40],)),
    ("long-revision-url", f"/adapters/{LONG}/generate", tgi(), 422, "validation", (LONG[:40],)),
    (
        "newline-before-alias",
        "/generate",
        tgi(adapter_id="fz-bot\n@production"),
        422,
        "validation",
        ("fz-bot\\n", "not valid"),
    ),
    (
        "newline-before-alias-url",
        "/adapters/fz-bot%0A@production/generate",
        tgi(),
        422,
        "validation",
        ("fz-bot\\n", "not valid"),
    ),
    (
        "non-ascii-digit",
        "/v1/completions",
        completion(model="fz-bot:r\u0663"),
        422,
        "validation",
        ("fz-bot:r\u0663", "not valid"),
    ),
    (
        "non-ascii-alias",
        "/v1/completions",
        completion(model="fz-bot@\u0661"),
        422,
        "validation",
        ("not valid",),
    ),
    (
        "newline-in-admitted-name",
        "/admin/admit",
        {"adapter": "fz-bot\n", "revision": 1},
        422,
        "validation",
        ("fz-bot\\n",),
    ),
    (
        "surrogate-feedback-id",
        "/v1/feedback",
        {"request_id": SURROGATE, "score": 1},
        422,
        "validation",
        ("request_id",),
    ),
]


def post(api: TestClient, path: str, body: dict[str, object]) -> httpx.Response:
    """`body` as JSON with its escapes (`"\\ud800"`), as a client sends what UTF-8 cannot hold."""
    content = json.dumps(body).encode("ascii")
    return api.post(path, content=content, headers={"Content-Type": "application/json"})


@pytest.fixture(scope="module")
def api(
    mlflow_server: ManagedProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TestClient]:
    home = tmp_path_factory.mktemp("hostile")
    with in_process_worker(mlflow_server, home) as worker, app_client(worker) as client:
        yield client


@pytest.mark.slow
@pytest.mark.parametrize(
    ("path", "body", "status", "error_type", "named"),
    [pytest.param(*case[1:], id=case[0]) for case in CASES],
)
def test_hostile_input_answers_4xx_naming_what_was_wrong(
    api: TestClient,
    path: str,
    body: dict[str, object],
    status: int,
    error_type: str,
    named: tuple[str, ...],
) -> None:
    answer = post(api, path, body)
    message = error_of(answer, status, error_type)
    for name in named:
        assert name in message, message
    assert len(answer.content) < 6 * ECHO_LIMIT


@pytest.mark.slow
@pytest.mark.parametrize("ref", [HUGE, LONG, "fz-bot\n@production", "fz-bot:r\u0663"])
def test_adapter_status_refuses_what_is_no_name(api: TestClient, ref: str) -> None:
    answer = api.get(f"/v1/adapters/{quote(ref, safe=':@')}")
    assert answer.status_code in (404, 422), answer.text
    assert len(answer.content) < 6 * ECHO_LIMIT


def test_the_table_covers_every_generation_route() -> None:
    paths = {case[1] for case in CASES}
    assert {*TGI_ROUTES, "/v1/completions", "/v1/chat/completions", "/admin/admit"} <= paths
