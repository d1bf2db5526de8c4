"""The worker's API with real clients: huggingface_hub's InferenceClient (TGI) and the openai
package, streaming and not, against a worker process serving 16 imported adapters; /metrics and
residency; and a load test of 32 concurrent clients checked answer by answer."""

import json
import os
import random
import threading
import time
from collections import Counter

import httpx
import openai
import pytest
from huggingface_hub import InferenceClient

from mint_core.config import MintConfig
from mint_core.model.base import BaseModel
from mint_core.model.toy import held_out_words, prompt_for
from processes import ManagedProcess
from serving.http.client import WorkerClient
from tasks.pipeline import admit_revision, prewarm_revision
from tests.integration.helpers import activate, register_random_adapter

pytestmark = pytest.mark.slow

ADAPTERS = [f"load-bot-{n:02d}" for n in range(16)]
PROMPTS = [prompt_for(word) for word in held_out_words()[:12]]
NEW_TOKENS = 12
LOAD_CLIENTS = 32
LOAD_SECONDS = float(os.environ.get("MINT_LOAD_TEST_SECONDS", "30"))


@pytest.fixture(scope="module")
def served(
    fleet_config: MintConfig, base: BaseModel, tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, str], str]:
    """(adapter, prompt) -> its single-request greedy answer, asked one request at a time."""
    folder = tmp_path_factory.mktemp("load-adapters")
    for seed, name in enumerate(ADAPTERS):
        revision = register_random_adapter(fleet_config, base, name, folder / name, seed)
        admit_revision.fn(fleet_config, revision)
        prewarm_revision.fn(fleet_config, revision)
        activate(fleet_config, revision)
    client = WorkerClient(fleet_config.worker_urls[0])
    answers = {
        (name, prompt): client.generate(prompt, f"{name}@production", NEW_TOKENS)[0]
        for name in ADAPTERS
        for prompt in PROMPTS
    }
    # The adapters differ: most prompts get several different answers across them.
    assert sum(len({answers[n, p] for n in ADAPTERS}) > 1 for p in PROMPTS) >= len(PROMPTS) // 2
    return answers


def test_huggingface_inference_client_text_generation(
    worker: ManagedProcess, served: dict[tuple[str, str], str]
) -> None:
    client = InferenceClient(base_url=worker.url)
    name, prompt = ADAPTERS[3], PROMPTS[0]
    expected = served[name, prompt]
    adapter_id = f"{name}@production"

    text = client.text_generation(prompt, adapter_id=adapter_id, max_new_tokens=NEW_TOKENS)
    assert text == expected
    detailed = client.text_generation(
        prompt, adapter_id=adapter_id, max_new_tokens=NEW_TOKENS, details=True
    )
    assert detailed.generated_text == expected
    assert detailed.details is not None
    assert detailed.details.generated_tokens == len(detailed.details.tokens)

    pieces = client.text_generation(
        prompt, adapter_id=adapter_id, max_new_tokens=NEW_TOKENS, stream=True
    )
    assert "".join(pieces) == expected
    events = list(
        client.text_generation(
            prompt, adapter_id=adapter_id, max_new_tokens=NEW_TOKENS, stream=True, details=True
        )
    )
    assert events[-1].generated_text == expected
    assert events[-1].details is not None
    assert all(e.generated_text is None for e in events[:-1])

    # Sampling with a seed repeats itself.
    sampled = [
        client.text_generation(prompt, adapter_id=adapter_id, max_new_tokens=NEW_TOKENS,
                               do_sample=True, temperature=0.9, top_k=20, seed=7)
        for _ in range(2)
    ]  # fmt: skip
    assert sampled[0] == sampled[1]


def test_openai_client_completions_and_chat(
    worker: ManagedProcess, served: dict[tuple[str, str], str], base: BaseModel
) -> None:
    client = openai.OpenAI(base_url=worker.url + "/v1", api_key="key-team-a", max_retries=0)
    name, prompt = ADAPTERS[5], PROMPTS[1]
    expected = served[name, prompt]
    model = f"{name}@production"

    completion = client.completions.create(
        model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0
    )
    assert completion.choices[0].text == expected
    assert completion.model == f"{name}:r1"
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in stream) == expected

    # Chat goes through the base's chat template: its answer is its own, the same streamed.
    messages = [{"role": "user", "content": prompt}]
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=NEW_TOKENS, temperature=0
    )
    chat_answer = chat.choices[0].message.content
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage is not None and chat.usage.prompt_tokens > len(prompt)  # the template's
    chunks = list(
        client.chat.completions.create(
            model=model, messages=messages, max_tokens=NEW_TOKENS, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat_answer
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")

    # A stop sequence is left out of the text, streaming or not (OpenAI's rule). It is taken
    # from the middle of an answer already given without one, so it does occur in it.
    long_answers = [(n, p, text) for (n, p), text in served.items() if len(text) >= 4]
    assert long_answers, f"no answer of 4 characters or more to cut a stop sequence from: {served}"
    name_with_stop, prompt_with_stop, full = long_answers[0]
    stop = full[2:4]
    cut = full[: full.index(stop)]
    stopped = client.completions.create(
        model=f"{name_with_stop}@production", prompt=prompt_with_stop, max_tokens=NEW_TOKENS,
        temperature=0, stop=[stop],
    )  # fmt: skip
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == (cut, "stop")

    # The same in a streamed chat. A random adapter's answer may be of any length (its first
    # token can end it): the stop sequence is the second character of the first chat answer,
    # over the adapters, that has two; the text it leaves is known from that answer.
    def chat_text(model: str) -> str:
        chat = client.chat.completions.create(
            model=model, messages=messages, max_tokens=NEW_TOKENS, temperature=0
        )
        return chat.choices[0].message.content or ""

    chat_model = model
    chats = {chat_model: chat_answer or ""}
    for other in ADAPTERS:
        if len(chats[chat_model]) >= 2:
            break
        chat_model = f"{other}@production"
        chats[chat_model] = chat_text(chat_model)
    answer = chats[chat_model]
    assert len(answer) >= 2, f"no chat answer of 2 characters or more to cut: {chats}"
    chat_stop = answer[1]
    streamed = client.chat.completions.create(
        model=chat_model, messages=messages, max_tokens=NEW_TOKENS, temperature=0, stop=chat_stop,
        stream=True,
    )  # fmt: skip
    chunks = list(streamed)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == answer[: answer.index(chat_stop)], (text, answer, chat_stop)
    assert chunks[-1].choices[0].finish_reason == "stop"

    models = {m.id: m for m in client.models.list()}
    assert models[f"{name}:r1"].model_extra["parent"] == base.model_id  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-bot", prompt=prompt, max_tokens=2)


def test_adapter_residency_and_metrics(
    worker: ManagedProcess, served: dict[tuple[str, str], str]
) -> None:
    status = httpx.get(f"{worker.url}/v1/adapters/{ADAPTERS[0]}").json()
    (revision,) = status["revisions"]
    assert revision["state"] == "ready"
    assert revision["residency"]["host"] is True
    assert revision["residency"]["pins"] == 0

    metrics = httpx.get(f"{worker.url}/metrics").text
    for name in (
        "mint_queue_depth",
        "mint_batch_size_bucket",
        "mint_generated_tokens_total",
        "mint_tokens_per_second",
        "mint_request_latency_seconds_bucket",
        "mint_time_to_first_token_seconds_bucket",
        'mint_tier_hits_total{tier="device"}',
        'mint_tier_loads_total{tier="host"}',
        'mint_tier_evictions_total{tier="device"}',
    ):
        assert name in metrics, name


def test_32_clients_over_16_adapters_for_30_s_get_their_single_request_answers(
    worker: ManagedProcess, served: dict[tuple[str, str], str]
) -> None:
    deadline = time.monotonic() + LOAD_SECONDS
    outcomes: Counter[str] = Counter()
    wrong: list[str] = []
    lock = threading.Lock()

    def client_loop(seed: int) -> None:
        pick = random.Random(seed)
        with httpx.Client(base_url=worker.url, timeout=60) as http:
            while time.monotonic() < deadline:
                name, prompt = pick.choice(ADAPTERS), pick.choice(PROMPTS)
                route = pick.choice(["tgi", "tgi-stream", "openai"])
                try:
                    text = ask(http, route, f"{name}@production", prompt)
                except Exception as e:  # every failure is counted and reported
                    with lock:
                        outcomes["error"] += 1
                        wrong.append(f"{route} {name} {prompt!r}: {type(e).__name__}: {e}")
                    continue
                with lock:
                    if text == served[name, prompt]:
                        outcomes["right"] += 1
                    else:
                        outcomes["wrong"] += 1
                        wrong.append(f"{route} {name} {prompt!r}: {text!r}")

    threads = [threading.Thread(target=client_loop, args=(n,)) for n in range(LOAD_CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(f"load test: {dict(outcomes)} in {LOAD_SECONDS:.0f} s from {LOAD_CLIENTS} clients")
    assert wrong == []
    assert outcomes["right"] >= LOAD_CLIENTS * 2


def ask(http: httpx.Client, route: str, model: str, prompt: str) -> str:
    """One greedy request over one of the worker's APIs; the generated text."""
    if route == "openai":
        body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
        response = http.post("/v1/completions", json=body)
        response.raise_for_status()
        return response.json()["choices"][0]["text"]
    body = {"inputs": prompt, "parameters": {"adapter_id": model, "max_new_tokens": NEW_TOKENS}}
    if route == "tgi":
        response = http.post("/generate", json=body)
        response.raise_for_status()
        return response.json()["generated_text"]
    with http.stream("POST", "/generate_stream", json=body) as stream:
        stream.raise_for_status()
        events = [json.loads(line.removeprefix("data:")) for line in stream.iter_lines()
                  if line.startswith("data:")]  # fmt: skip
    final = [event for event in events if event.get("generated_text") is not None]
    assert len(final) == 1, events
    return final[0]["generated_text"]
