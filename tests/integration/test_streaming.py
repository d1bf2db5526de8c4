"""Text over the worker's HTTP API is the base's own: answers with multi-byte characters (é, 中,
an emoji, whose UTF-8 bytes are separate tokens of the byte-level tokenizer) stream in pieces
that add up to exactly the non-streamed text, over TGI and OpenAI, completions and chat; a
generation ends at any end-of-sequence id of the base (`</s>` and `<|im_end|>`); chat needs
the base's chat template (422 without one); a prompt that does not fit the context answers 422
with both numbers.

The base is a tiny Llama whose greedy answer is forced (each token's embedding is a one-hot
direction that the output layer maps to the next token of the answer), so the characters come
out every time; its layers are random and run as in any model. The app runs in this process
over a real worker."""

import itertools
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from transformers import LlamaForCausalLM

from mint_core.artifacts.folders import publish_folder
from mint_core.artifacts.stores import open_store
from mint_core.catalog.catalog import Catalog
from mint_core.config import MintConfig
from mint_core.model.base import BaseModel, BaseSource, load_base
from mint_core.model.generate import seeded
from mint_core.model.tiny import EOS, IM_END, TinySpec, byte_tokenizer, save_base_folder
from mint_core.registry import Registry
from processes import ManagedProcess
from serving.backends.embedded import EmbeddedBackend
from serving.engine.engine import TorchEngine
from serving.http.app import create_app
from serving.worker.worker import Worker

ANSWERS = {"=": ("é中😀", IM_END), "\n": ("é中😀", IM_END), "?": ("¢", EOS)}
"""The forced greedy answer after a prompt's last character, and the end token after it. A chat
prompt ends with the template's `<|im_start|>assistant\\n`."""
PIECES = ["", "é", "", "", "中", "", "", "", "😀", ""]
"""What each token of `é中😀<|im_end|>` adds to the text: nothing until a character's last byte."""
SPEC = TinySpec(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, pretrain_steps=0)
CHAT = [{"role": "user", "content": "Say something."}]


def forced_base_folder(root: Path) -> Path:
    """A model folder whose greedy answers are `ANSWERS`, whatever comes before the last
    character of the prompt."""
    folder = root / "forced"
    tokenizer = byte_tokenizer()

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    successor: dict[int, int] = {}
    for last, (answer, end) in ANSWERS.items():
        chain = [*ids(last), *ids(answer), tokenizer.convert_tokens_to_ids(end)]
        for token, following in itertools.pairwise(chain):
            assert successor.setdefault(token, following) == following, "ambiguous answers"
    with seeded(0):
        model = LlamaForCausalLM(SPEC.model_config())
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(torch.zeros_like(model.lm_head.weight))
    with torch.no_grad():
        for direction, (token, following) in enumerate(successor.items()):
            # The layers' random contributions are small beside this: after the final norm the
            # direction stands out, and the output layer reads it as `following`.
            model.model.embed_tokens.weight[token] = 0
            model.model.embed_tokens.weight[token, direction] = 100.0
            model.lm_head.weight[following, direction] = 1.0
    with publish_folder(folder, prefix=".forced-") as staging:
        save_base_folder(model, staging)
    return folder


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("streaming")


@pytest.fixture(scope="module")
def folders(home: Path) -> dict[str, Path]:
    """The forced base, and the same base without a chat template."""
    forced = forced_base_folder(home)
    plain = home / "forced-no-chat-template"
    shutil.copytree(forced, plain, ignore=shutil.ignore_patterns("chat_template.jinja"))
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    return {"chat": forced, "plain": plain}


def serving(base: BaseModel, home: Path, tracking_uri: str) -> Iterator[TestClient]:
    config = MintConfig(home=home, tracking_uri=tracking_uri)
    catalog = Catalog(Registry(tracking_uri))
    backend = EmbeddedBackend(TorchEngine(base), config.host_cache_mb << 20)
    worker = Worker(backend, catalog, open_store(config), sync_interval_s=3600).start()
    try:
        with TestClient(create_app(worker)) as client:
            yield client
    finally:
        worker.close()


@pytest.fixture(scope="module")
def api(
    folders: dict[str, Path], home: Path, mlflow_server: ManagedProcess
) -> Iterator[TestClient]:
    base = load_base(BaseSource(str(folders["chat"])), home)
    yield from serving(base, home, mlflow_server.url)


@pytest.fixture(scope="module")
def plain_api(
    folders: dict[str, Path], home: Path, mlflow_server: ManagedProcess
) -> Iterator[TestClient]:
    base = load_base(BaseSource(str(folders["plain"])), home)
    assert not base.codec.has_chat_template
    yield from serving(base, home, mlflow_server.url)


def events(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text
    lines = response.text.splitlines()
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    return [json.loads(text) for text in data if text != "[DONE]"]


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def test_tgi_streams_each_tokens_piece_and_they_add_up_to_the_generated_text(
    api: TestClient,
) -> None:
    body = {"inputs": "Say it=", "parameters": {"max_new_tokens": 30, "details": True}}
    whole = ok(api.post("/generate", json=body))
    assert whole["generated_text"] == "é中😀"
    details = whole["details"]
    assert [token["text"] for token in details["tokens"]] == PIECES
    assert (details["finish_reason"], details["generated_tokens"]) == ("eos_token", 10)

    streamed = events(api.post("/generate_stream", json=body))
    assert [event["token"]["text"] for event in streamed] == PIECES
    assert [event["token"]["id"] for event in streamed] == [
        token["id"] for token in details["tokens"]
    ]
    assert streamed[-1]["generated_text"] == whole["generated_text"]
    assert [event["generated_text"] for event in streamed[:-1]] == [None] * 9


@pytest.mark.parametrize(
    ("inputs", "max_new_tokens", "text", "reason"),
    [
        ("Say it=", 30, "é中😀", "eos_token"),
        ("Say it=", 4, "é\ufffd", "length"),  # cut inside 中: the last piece holds the rest
        ("Say it?", 30, "¢", "eos_token"),
    ],
)
def test_tgi_pieces_add_up_to_the_text_however_it_ends(
    api: TestClient, inputs: str, max_new_tokens: int, text: str, reason: str
) -> None:
    body = {"inputs": inputs, "parameters": {"max_new_tokens": max_new_tokens, "details": True}}
    whole = ok(api.post("/generate", json=body))
    assert (whole["generated_text"], whole["details"]["finish_reason"]) == (text, reason)
    streamed = events(api.post("/generate_stream", json=body))
    assert "".join(event["token"]["text"] for event in streamed) == text
    assert streamed[-1]["generated_text"] == text


@pytest.mark.parametrize(
    ("inputs", "end_id", "tokens"),
    [("Say it=", 4, 10), ("Say it?", 2, 3)],
    ids=["im_end", "eos"],
)
def test_a_generation_ends_at_either_end_of_sequence_id(
    api: TestClient, inputs: str, end_id: int, tokens: int
) -> None:
    body = {"inputs": inputs, "parameters": {"max_new_tokens": 40, "details": True}}
    details = ok(api.post("/generate", json=body))["details"]
    assert (details["finish_reason"], details["generated_tokens"]) == ("eos_token", tokens)
    last = details["tokens"][-1]
    assert (last["id"], last["text"], last["special"]) == (end_id, "", True)
    assert not any(token["special"] for token in details["tokens"][:-1])


def openai_pieces(path: str, response: httpx.Response) -> tuple[list[str], str | None]:
    """The text of each chunk of an OpenAI stream, and the last chunk's finish reason."""
    chunks = [event["choices"][0] for event in events(response)]
    key = "text" if path == "/v1/completions" else "delta"
    texts = [c[key] if key == "text" else c[key]["content"] for c in chunks]
    return texts, chunks[-1]["finish_reason"]


def openai_text(path: str, response: httpx.Response) -> tuple[str, str]:
    choice = ok(response)["choices"][0]
    text = choice["text"] if path == "/v1/completions" else choice["message"]["content"]
    return text, choice["finish_reason"]


@pytest.mark.parametrize(
    ("path", "prompt"),
    [("/v1/completions", {"prompt": "Say it="}), ("/v1/chat/completions", {"messages": CHAT})],
)
@pytest.mark.parametrize(
    ("options", "text", "finish"),
    [
        ({"max_tokens": 30}, "é中😀", "stop"),
        ({"max_tokens": 4}, "é\ufffd", "length"),
        # OpenAI leaves the stop sequence out, holding back text that may start one.
        ({"max_tokens": 30, "stop": ["中"]}, "é", "stop"),
        ({"max_tokens": 30, "stop": ["😀"]}, "é中", "stop"),
    ],
)
def test_openai_streams_add_up_to_the_non_streamed_text(
    api: TestClient, path: str, prompt: dict, options: dict, text: str, finish: str
) -> None:
    body = {"model": "base", "temperature": 0, **prompt, **options}
    assert openai_text(path, api.post(path, json=body)) == (text, finish)
    pieces, streamed_finish = openai_pieces(path, api.post(path, json=body | {"stream": True}))
    assert ("".join(pieces), streamed_finish) == (text, finish)
    if "stop" not in options and finish == "stop":
        assert pieces == ["é", "中", "😀", ""]  # one chunk per character, then the end


def test_chat_applies_the_template_and_counts_its_tokens(api: TestClient) -> None:
    body = {"model": "base", "temperature": 0, "messages": CHAT, "max_tokens": 30}
    usage = ok(api.post("/v1/chat/completions", json=body))["usage"]
    # <s>, then `<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n`.
    chat_tokens = 1 + 1 + len("user\nSay something.") + 1 + 1 + 1 + len("assistant\n")
    assert usage == {
        "prompt_tokens": chat_tokens,
        "completion_tokens": 10,
        "total_tokens": 10 + chat_tokens,
    }
    completion = {"model": "base", "temperature": 0, "prompt": "Say it=", "max_tokens": 30}
    usage = ok(api.post("/v1/completions", json=completion))["usage"]
    assert usage["prompt_tokens"] == 1 + len("Say it=")


def test_chat_on_a_base_without_a_chat_template_answers_422_naming_it(
    plain_api: TestClient,
) -> None:
    body = {"model": "base", "temperature": 0, "messages": CHAT, "max_tokens": 30}
    for stream in (False, True):
        response = plain_api.post("/v1/chat/completions", json=body | {"stream": stream})
        assert response.status_code == 422, response.text
        assert response.json()["error_type"] == "validation"
        message = response.json()["error"]
        assert "forced-no-chat-template has no chat template" in message
        assert "/v1/completions" in message
    completion = {"model": "base", "temperature": 0, "prompt": "Say it=", "max_tokens": 30}
    assert openai_text("/v1/completions", plain_api.post("/v1/completions", json=completion)) == (
        "é中😀",
        "stop",
    )


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"inputs": "x" * 110 + "=", "parameters": {"max_new_tokens": 20}}),
        ("/generate_stream", {"inputs": "x" * 110 + "=", "parameters": {"max_new_tokens": 20}}),
        ("/v1/completions", {"model": "base", "prompt": "x" * 110 + "=", "max_tokens": 20}),
        (
            "/v1/chat/completions",
            {
                "model": "base",
                "messages": [{"role": "user", "content": "x" * 92}],
                "max_tokens": 20,
                "stream": True,
            },
        ),
    ],
)
def test_a_prompt_that_does_not_fit_the_context_answers_422_with_both_numbers(
    api: TestClient, path: str, body: dict
) -> None:
    # 112 prompt tokens (BOS and 111 bytes; or 92 bytes in the chat template's 20 tokens) and 20
    # new ones do not fit a context of 128.
    response = api.post(path, json=body)
    assert response.status_code == 422, response.text
    message = response.json()["error"]
    assert "prompt's 112 tokens plus max_new_tokens=20 do not fit the context" in message
    assert "(128 tokens)" in message


def test_health_and_models_name_the_base(api: TestClient, folders: dict[str, Path]) -> None:
    health = ok(api.get("/health"))
    assert health["base_model"] == folders["chat"].name == "forced"
    assert (health["base_family"], health["context_length"]) == ("llama", SPEC.context_length)
    assert health["base_digest"].startswith("sha256:")
    assert [model["id"] for model in ok(api.get("/v1/models"))["data"]] == ["forced"]
