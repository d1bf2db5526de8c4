"""TGI's own Python client, `text-generation` 0.7, which cannot name an adapter, pointed at an
adapter's base URL (`/adapters/{ref}`) on a worker and on the gateway: generate, generate_stream
and chat answer exactly what the same revision answers through `adapter_id` / `model`, and the
readiness gate, access policy and unknown adapters answer the client's own errors.

The client requires huggingface-hub<1.0, which MinT's transformers cannot import: it runs in an
environment of its own (`make tgi-client`: .venv-tgi), as its users install it, driven by the
small script below in a child process."""

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mint_core.config import MintConfig
from mint_core.model.base import BaseModel
from mint_core.model.toy import held_out_words, prompt_for
from processes import ManagedProcess
from serving.gateway import start_gateway
from tasks.pipeline import admit_revision, prewarm_revision
from tests.integration.helpers import activate, register_random_adapter

pytestmark = pytest.mark.slow

TGI_PYTHON = Path(__file__).resolve().parents[2] / ".venv-tgi" / "bin" / "python"
PROMPTS = [prompt_for(word) for word in held_out_words()[:3]]
NEW_TOKENS = 12
KEY = "key-team-a"

# Each call's result as JSON; the client's exception (its class, from text_generation.errors)
# for an error answer.
CLIENT = """
import json, sys
from text_generation import Client

job = json.load(sys.stdin)
results = []
for call in job["calls"]:
    client = Client(call["base_url"], headers=job["headers"], timeout=120)
    op, prompt, tokens = call["op"], call["prompt"], call["tokens"]
    try:
        if op == "generate":
            answer = client.generate(prompt, max_new_tokens=tokens)
            results.append({"text": answer.generated_text,
                            "token_ids": [t.id for t in answer.details.tokens]})
        elif op == "generate_stream":
            events = list(client.generate_stream(prompt, max_new_tokens=tokens))
            results.append({"text": events[-1].generated_text,
                            "token_ids": [e.token.id for e in events],
                            "pieces": "".join(e.token.text for e in events if not e.token.special)})
        else:
            chat = client.chat([{"role": "user", "content": prompt}], max_tokens=tokens,
                               temperature=0)
            results.append({"text": chat.choices[0].message.content, "model": chat.model})
    except Exception as e:
        results.append({"error": f"{type(e).__module__}.{type(e).__name__}", "message": str(e)})
json.dump(results, sys.stdout)
"""


def tgi_client(calls: list[dict[str, object]]) -> list[dict[str, object]]:
    """What `text_generation.Client(base_url, headers=...)` answers to each call, in one child
    process (its imports take a second)."""
    if not TGI_PYTHON.exists():
        pytest.fail(f"{TGI_PYTHON} does not exist: build TGI's client's environment with `make`")
    job = {"headers": {"Authorization": f"Bearer {KEY}"}, "calls": calls}
    done = subprocess.run(
        [str(TGI_PYTHON), "-c", CLIENT],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def calls(base_url: str, op: str, prompts: list[str] = PROMPTS) -> list[dict[str, object]]:
    """`op` (generate, generate_stream or chat) for each of `prompts`, at `base_url`."""
    return [
        {"base_url": base_url, "op": op, "prompt": prompt, "tokens": NEW_TOKENS}
        for prompt in prompts
    ]


@pytest.fixture(scope="module")
def released(
    fleet_config: MintConfig, base: BaseModel, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, str]:
    """Adapter name -> its production revision: `tgi-bot` for everyone, `tgi-team-b` for team-b
    only; and `tgi-bot:r2`, registered and never admitted."""
    folder = tmp_path_factory.mktemp("tgi-adapters")
    released = {}
    for seed, (name, principals) in enumerate([("tgi-bot", ("*",)), ("tgi-team-b", ("team-b",))]):
        revision = register_random_adapter(
            fleet_config, base, name, folder / name, 40 + seed, principals
        )
        admit_revision.fn(fleet_config, revision)
        prewarm_revision.fn(fleet_config, revision)
        activate(fleet_config, revision)
        released[name] = str(revision)
    register_random_adapter(fleet_config, base, "tgi-bot", folder / "tgi-bot-2", 42)
    return released


@pytest.fixture(scope="module")
def gateway(fleet_config: MintConfig, worker: ManagedProcess) -> Iterator[ManagedProcess]:
    process = start_gateway(fleet_config)
    yield process
    process.stop()


def reference(worker: ManagedProcess, model: str | None) -> dict[str, list[dict[str, object]]]:
    """Per prompt, what the worker answers when the request names `model` itself: TGI's
    `adapter_id` (with token ids) and OpenAI chat's `model` (greedy, as the client asks)."""
    headers = {"Authorization": f"Bearer {KEY}"}
    generated, chats = [], []
    for prompt in PROMPTS:
        parameters = {"adapter_id": model, "max_new_tokens": NEW_TOKENS, "details": True}
        answer = httpx.post(
            worker.url + "/generate",
            json={"inputs": prompt, "parameters": parameters},
            headers=headers,
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        body = answer.json()
        token_ids = [token["id"] for token in body["details"]["tokens"]]
        generated.append({"text": body["generated_text"], "token_ids": token_ids})
        chat = {
            "model": model or "base",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": NEW_TOKENS,
            "temperature": 0,
        }
        answer = httpx.post(
            worker.url + "/v1/chat/completions", json=chat, headers=headers, timeout=60
        )
        assert answer.status_code == 200, answer.text
        chats.append({"text": answer.json()["choices"][0]["message"]["content"]})
    return {"generate": generated, "chat": chats}


@pytest.mark.parametrize("front", ["worker", "gateway"])
def test_text_generation_client_at_an_adapters_base_url_gets_that_revision(
    front: str,
    worker: ManagedProcess,
    released: dict[str, str],
    request: pytest.FixtureRequest,
) -> None:
    url = request.getfixturevalue(front).url
    expected = reference(worker, "tgi-bot@production")
    # The adapter changes what the base answers, so an answer of the base would be seen.
    assert expected["generate"] != reference(worker, None)["generate"]

    texts = [e["text"] for e in expected["generate"]]
    for ref in ("tgi-bot@production", released["tgi-bot"]):
        adapter_url = f"{url}/adapters/{ref}"
        ops = ("generate", "generate_stream", "chat")
        answers = tgi_client([call for op in ops for call in calls(adapter_url, op)])
        generated, streamed, chats = (answers[n : n + len(PROMPTS)] for n in (0, 3, 6))
        assert generated == expected["generate"], ref
        assert [s["token_ids"] for s in streamed] == [e["token_ids"] for e in expected["generate"]]
        assert [s["text"] for s in streamed] == [s["pieces"] for s in streamed] == texts
        assert chats == [c | {"model": released["tgi-bot"]} for c in expected["chat"]], ref

    # The other routes under the adapter's URL, as any HTTP client sends them.
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": NEW_TOKENS}}
    adapter_url = f"{url}/adapters/tgi-bot@production"
    answer = httpx.post(adapter_url + "/generate", json=body, headers=headers, timeout=60)
    assert answer.json()["generated_text"] == expected["generate"][0]["text"]
    assert answer.headers["X-Mint-Revision"] == released["tgi-bot"]
    with httpx.stream(
        "POST", adapter_url + "/generate_stream", json=body, headers=headers, timeout=60
    ) as stream:
        events = [json.loads(line[5:]) for line in stream.iter_lines() if line.startswith("data:")]
    assert events[-1]["generated_text"] == expected["generate"][0]["text"]
    # A body naming another revision than the URL is refused, not either one chosen.
    other = {"inputs": PROMPTS[0], "parameters": {"adapter_id": "tgi-team-b@production"}}
    answer = httpx.post(adapter_url + "/generate", json=other, headers=headers, timeout=60)
    assert answer.status_code == 422, answer.text
    assert "tgi-team-b@production" in answer.json()["error"]


@pytest.mark.parametrize("front", ["worker", "gateway"])
def test_the_gate_and_policy_answer_the_text_generation_clients_errors(
    front: str, released: dict[str, str], request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue(front).url
    ops = ("generate", "generate_stream", "chat")
    refs = ("no-such-bot@production", "tgi-team-b@production", "tgi-bot:r2")
    answers = tgi_client(
        [
            call
            for ref in refs
            for op in ops
            for call in calls(f"{url}/adapters/{ref}", op, [PROMPTS[0]])
        ]
    )
    unknown, refused, gated = (answers[n : n + len(ops)] for n in (0, 3, 6))
    assert {u["error"] for u in unknown} == {"text_generation.errors.NotFoundError"}, unknown
    assert all("no-such-bot" in u["message"] for u in unknown), unknown
    # team-a may not use team-b's adapter: 403, which this client calls ShardNotReadyError.
    assert {r["error"] for r in refused} == {"text_generation.errors.ShardNotReadyError"}
    assert all("may not use" in r["message"] for r in refused), refused
    # Registered, never admitted: the readiness gate's answer at once, on every route.
    assert all("tgi-bot:r2" in g.get("message", "") for g in gated), gated
    answer = httpx.post(
        f"{url}/adapters/tgi-bot:r2",
        json={"inputs": PROMPTS[0]},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert answer.status_code == 503 and answer.json()["error_type"] == "not_ready", answer.text
