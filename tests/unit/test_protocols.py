"""The protocols' translations, from hand-built token events and generations to TGI's and
OpenAI's bodies and server-sent events, with no worker (the limits on hostile input, over a
real worker, are tests/integration/test_request_limits.py)."""

import json
from collections.abc import Iterable, Iterator

import pytest

from mint_core.errors import ConfigurationError
from mint_core.model.generate import FinishReason, Generation
from serving.engine.generation import TokenEvent
from serving.protocols import Event, openai, tgi

CONTEXT = 128
"""The context length the translations are given."""
SPECIAL = frozenset({2})
HEAD = openai.Head("cmpl-1", 1_700_000_000, "some-bot:r1")
CHAT = [{"role": "user", "content": "a="}]


def events_of(pieces: list[str], finish: FinishReason, seed: int | None = None) -> list[Event]:
    """The events of a generation whose tokens (ids 10, 11, ...) add `pieces` to its text."""
    tokens = [TokenEvent(10 + i, piece, -0.5 * i) for i, piece in enumerate(pieces)]
    generation = Generation(
        text="".join(pieces),
        token_ids=tuple(token.token_id for token in tokens),
        logprobs=tuple(token.logprob for token in tokens),
        finish_reason=finish,
        seed=seed,
    )
    return [*tokens, generation]


def data(stream: Iterable[str]) -> list[object]:
    """The payloads of server-sent events; `[DONE]` as the string it is."""
    payloads: list[object] = []
    for event in stream:
        assert event.startswith("data: ") and event.endswith("\n\n"), event
        text = event.removeprefix("data: ").removesuffix("\n\n")
        payloads.append(text if text == "[DONE]" else json.loads(text))
    return payloads


# TGI.


def test_tgi_body_is_the_text_and_with_details_each_token() -> None:
    events = events_of(["He", "llo", ""], FinishReason.EOS_TOKEN, seed=7)
    request = tgi.GenerateRequest(inputs="Say: ", parameters={"details": True})
    assert tgi.generated(events, request, frozenset({12})) == {
        "generated_text": "Hello",
        "details": {
            "finish_reason": "eos_token",
            "generated_tokens": 3,
            "seed": 7,
            "prefill": [],
            "tokens": [
                {"id": 10, "text": "He", "logprob": 0.0, "special": False},
                {"id": 11, "text": "llo", "logprob": -0.5, "special": False},
                {"id": 12, "text": "", "logprob": -1.0, "special": True},
            ],
        },
    }
    plain = tgi.GenerateRequest(inputs="Say: ", parameters={"return_full_text": True})
    assert tgi.generated(events, plain, SPECIAL) == {"generated_text": "Say: Hello"}


def test_tgi_stream_sends_each_token_and_the_totals_with_the_last() -> None:
    events = events_of(["a", "b##"], FinishReason.STOP_SEQUENCE, seed=3)
    request = tgi.GenerateRequest(inputs="x", parameters={"stop": ["##"]})
    first, last = data(tgi.stream(events, request, SPECIAL))
    assert first == {
        "index": 0,
        "token": {"id": 10, "text": "a", "logprob": 0.0, "special": False},
        "generated_text": None,
        "details": None,
    }
    # TGI keeps the stop sequence in the text.
    assert last == {
        "index": 1,
        "token": {"id": 11, "text": "b##", "logprob": -0.5, "special": False},
        "generated_text": "ab##",
        "details": {"finish_reason": "stop_sequence", "generated_tokens": 2, "seed": 3},
    }


def test_tgi_stream_ends_with_its_events_when_they_fail() -> None:
    def failing() -> Iterator[Event]:
        yield from events_of(["a", "b"], FinishReason.LENGTH)[:2]
        raise RuntimeError("the engine failed")

    stream = tgi.stream(failing(), tgi.GenerateRequest(inputs="x"), SPECIAL)
    assert [event["index"] for event in data([next(stream)])] == [0]  # type: ignore[index]
    with pytest.raises(RuntimeError, match="the engine failed"):
        next(stream)


@pytest.mark.parametrize(
    ("parameters", "temperature"),
    [
        ({}, 0.0),
        ({"temperature": 1.0}, 0.0),  # neutral: still greedy, as TGI has it
        ({"temperature": 0.7}, 0.7),
        ({"top_k": 5}, 1.0),
        ({"top_p": 0.9}, 1.0),
        ({"do_sample": True}, 1.0),
    ],
)
def test_tgi_samples_when_asked_or_when_a_knob_moves(
    parameters: dict[str, object], temperature: float
) -> None:
    params = tgi.GenerateParameters(**parameters).sampling(CONTEXT)
    assert (params.temperature, params.max_new_tokens) == (temperature, 20)


# OpenAI.


@pytest.mark.parametrize(
    ("finish", "text", "visible", "reason"),
    [
        (FinishReason.STOP_SEQUENCE, "Hello##", "Hello", "stop"),
        (FinishReason.EOS_TOKEN, "Hello##", "Hello##", "stop"),  # "##" here is no stop
        (FinishReason.LENGTH, "Hel", "Hel", "length"),
    ],
)
def test_openai_leaves_the_stop_sequence_out_and_has_two_finish_reasons(
    finish: FinishReason, text: str, visible: str, reason: str
) -> None:
    generation = Generation(text, (1,), (0.0,), finish)
    assert openai.visible_text(generation, ("##", "END")) == visible
    assert openai.finish_reason(generation) == reason


def test_a_completion_answers_each_prompt_with_its_token_ids_and_counts_all() -> None:
    first = events_of(["4", "2"], FinishReason.EOS_TOKEN)[-1]
    second = events_of(["no##"], FinishReason.STOP_SEQUENCE)[-1]
    assert isinstance(first, Generation) and isinstance(second, Generation)
    body = openai.completion(HEAD, [[1, 5, 6], [1, 7]], [first, second], ("##",), token_ids=True)
    assert body == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1_700_000_000,
        "model": "some-bot:r1",
        "choices": [
            {
                "index": 0,
                "text": "42",
                "logprobs": None,
                "finish_reason": "stop",
                "prompt_token_ids": [1, 5, 6],
                "token_ids": (10, 11),
            },
            {
                "index": 1,
                "text": "no",
                "logprobs": None,
                "finish_reason": "stop",
                "prompt_token_ids": [1, 7],
                "token_ids": (10,),
            },
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
    }
    without = openai.completion(HEAD, [[1, 5, 6]], [first], (), token_ids=False)
    assert set(without["choices"][0]) == {"index", "text", "logprobs", "finish_reason"}  # type: ignore[index]


def test_a_chat_completion_is_one_message_and_its_prompt_token_ids() -> None:
    generation = events_of(["Hi", "!"], FinishReason.LENGTH)[-1]
    assert isinstance(generation, Generation)
    head = openai.Head("chatcmpl-1", 5, "base-model")
    body = openai.chat_completion(head, [1, 2, 3, 4], generation, (), token_ids=True)
    assert body == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 5,
        "model": "base-model",
        "system_fingerprint": "base-model",
        "prompt_token_ids": [1, 2, 3, 4],
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hi!"},
                "logprobs": None,
                "finish_reason": "length",
                "token_ids": (10, 11),
            }
        ],
        "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
    }


@pytest.mark.parametrize(
    ("pieces", "finish", "stop", "sent"),
    [
        (["a", "b", "c"], FinishReason.LENGTH, (), ["a", "b", "c", ""]),
        # A stop sequence split over tokens: its start is held back, then never sent.
        (["Hi", " #", "#"], FinishReason.STOP_SEQUENCE, ("##",), ["Hi", " ", ""]),
        # Held-back text that turned out not to be a stop sequence comes with the end.
        (["Hi", " #", "!"], FinishReason.EOS_TOKEN, ("##",), ["Hi", " ", "#!"]),
        (["", "é", ""], FinishReason.EOS_TOKEN, (), ["é", ""]),
    ],
)
def test_openai_streams_pieces_that_add_up_to_the_visible_text(
    pieces: list[str], finish: FinishReason, stop: tuple[str, ...], sent: list[str]
) -> None:
    events = events_of(pieces, finish)
    streamed = list(openai.pieces(events, stop))
    assert [text for text, _ in streamed] == sent
    assert [reason for _, reason in streamed] == [None] * (len(sent) - 1) + [
        "length" if finish is FinishReason.LENGTH else "stop"
    ]
    generation = events[-1]
    assert isinstance(generation, Generation)
    assert "".join(sent) == openai.visible_text(generation, stop)


def test_openai_stream_chunks_end_with_done_and_chat_names_the_role_first() -> None:
    events = events_of(["a", "b"], FinishReason.LENGTH)
    *chunks, done = data(openai.completion_stream(events, HEAD, ()))
    assert done == "[DONE]"
    assert [chunk["choices"] for chunk in chunks] == [  # type: ignore[index]
        [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
        for text, finish in [("a", None), ("b", None), ("", "length")]
    ]
    assert {(c["id"], c["object"], c["model"]) for c in chunks} == {  # type: ignore[index]
        ("cmpl-1", "text_completion", "some-bot:r1")
    }
    *chunks, done = data(openai.chat_stream(events, HEAD, ()))
    assert done == "[DONE]"
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]  # type: ignore[index]
    assert deltas == [{"content": "a", "role": "assistant"}, {"content": "b"}, {"content": ""}]
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}  # type: ignore[index]


def test_models_lists_the_base_then_each_revision_with_the_base_as_parent() -> None:
    model = {"object": "model", "created": 9, "owned_by": "mint"}
    assert openai.models("tiny", ["a-bot:r1", "b-bot:r2"], 9) == {
        "object": "list",
        "data": [
            {"id": "tiny"} | model,
            {"id": "a-bot:r1"} | model | {"parent": "tiny"},
            {"id": "b-bot:r2"} | model | {"parent": "tiny"},
        ],
    }


def test_openai_sampling_defaults_and_the_field_that_asks_for_tokens() -> None:
    params = openai.CompletionRequest(model="m", prompt="p", stop="##").sampling(CONTEXT)
    assert (params.temperature, params.max_new_tokens, params.stop) == (1.0, 16, ("##",))
    both = openai.ChatRequest(model="m", messages=CHAT, max_tokens=5, max_completion_tokens=7)
    assert both.sampling(CONTEXT).max_new_tokens == 7
    with pytest.raises(ConfigurationError, match=r"^max_completion_tokens=128 does not fit"):
        both.model_copy(update={"max_completion_tokens": 128}).sampling(CONTEXT)
    with pytest.raises(ConfigurationError, match="n=2"):
        openai.CompletionRequest(model="m", prompt="p", n=2).sampling(CONTEXT)


def test_completion_prompts() -> None:
    assert openai.CompletionRequest(model="m", prompt="p").prompts() == ["p"]
    assert openai.CompletionRequest(model="m", prompt=["p", "q"]).prompts() == ["p", "q"]
    with pytest.raises(ConfigurationError, match="empty list"):
        openai.CompletionRequest(model="m", prompt=[]).prompts()
    with pytest.raises(ConfigurationError, match="streaming takes one prompt"):
        openai.CompletionRequest(model="m", prompt=["p", "q"], stream=True).prompts()
    too_many = openai.CompletionRequest(model="m", prompt=["p"] * (openai.MAX_PROMPTS + 1))
    with pytest.raises(ConfigurationError, match=f"{len(too_many.prompt)} prompts; send at most"):
        too_many.prompts()
