"""The user's JSONL training data: every bad input refused with `FILE:LINE` and the reason
before any training, and the loss mask on exactly the answer (a completion and its
end-of-sequence, or the assistant turns of a chat). No servers, no model: the embedded
default's byte tokenizer and chat template."""

import hashlib
import json
import re
from pathlib import Path

import pytest

from mint_core.errors import DatasetError
from mint_core.model.datasets import (
    IGNORE,
    Dataset,
    Tokenized,
    parse_jsonl,
    tokenize,
)
from mint_core.model.text import TextCodec
from mint_core.model.tiny import byte_tokenizer

SOURCE = "data/train.jsonl"
GOOD = '{"prompt": "abc=", "completion": "cba"}'


def parse(*lines: str) -> Dataset:
    return parse_jsonl("".join(line + "\n" for line in lines).encode(), SOURCE)


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec(byte_tokenizer(), None, "tiny-test")


def labelled_spans(example: Tokenized, codec: TextCodec) -> list[str]:
    """The text of each run of consecutive positions that carry a loss, special tokens kept."""
    spans: list[list[int]] = []
    previous = IGNORE
    for token, label in zip(example.input_ids, example.labels, strict=True):
        if label != IGNORE:
            assert label == token  # a causal LM's label is the token itself (HF shifts)
            if previous == IGNORE:
                spans.append([])
            spans[-1].append(token)
        previous = label
    return [codec.tokenizer.decode(ids, skip_special_tokens=False) for ids in spans]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([GOOD, '{"prompt": "abc=", "completion": "cba"'],
         rf"^{SOURCE}:2: not valid JSON .*write one JSON object per line"),
        ([GOOD, GOOD, '{"prompt": "abc="}'],
         rf"^{SOURCE}:3: missing field 'completion'; a row needs 'prompt' and 'completion', "
         "or 'messages'"),
        (['{"text": "abc"}'], rf"^{SOURCE}:1: missing field 'prompt' and 'completion'"),
        (["[1, 2]"], rf"^{SOURCE}:1: a row must be a JSON object, not list"),
        (['{"prompt": "abc=", "completion": 7}'],
         rf"^{SOURCE}:1: 'completion' must be a string, not 7"),
        (['{"prompt": "abc=", "completion": ""}'],
         rf"^{SOURCE}:1: 'completion' is empty"),
        ([GOOD, '{"messages": [{"role": "user", "content": "hi"}]}'],
         rf"^{SOURCE}:2: no assistant message; the loss is on assistant turns, add one"),
        (['{"messages": []}'], rf"^{SOURCE}:1: 'messages' must be a non-empty list"),
        (['{"messages": [{"role": "robot", "content": "hi"}]}'],
         rf"^{SOURCE}:1: messages\[0\] is .*'role' \(one of assistant, system, tool, user\)"),
        (['{"messages": [{"role": ["user"], "content": "hi"}]}'],
         rf"^{SOURCE}:1: messages\[0\] is .*'role'"),
        (['{"messages": [{"role": "assistant", "content": null}]}'],
         rf"^{SOURCE}:1: messages\[0\] is .*a string 'content'"),
        ([], rf"^{SOURCE}: the file has no rows; write one JSON object per line"),
        (["", "   ", ""], rf"^{SOURCE}: the file has no rows"),
    ],
    ids=["malformed", "missing-completion", "missing-both", "not-an-object", "not-a-string",
         "empty-completion", "no-assistant", "no-messages", "unknown-role", "role-not-a-string",
         "content-not-a-string", "empty-file", "blank-lines-only"],
)  # fmt: skip
def test_bad_rows_are_refused_naming_file_line_and_reason(lines: list[str], message: str) -> None:
    with pytest.raises(DatasetError, match=message):
        parse(*lines)


def test_line_numbers_count_blank_lines_and_crlf() -> None:
    data = f"{GOOD}\r\n\r\n{GOOD}\r\n{{oops\r\n".encode()
    with pytest.raises(DatasetError, match=rf"^{SOURCE}:4: not valid JSON"):
        parse_jsonl(data, SOURCE)
    dataset = parse_jsonl(f"{GOOD}\r\n\r\n{GOOD}\r\n".encode(), SOURCE)
    assert [row.line for row in dataset.rows] == [1, 3]
    assert dataset.rows[1].completion == "cba"


def test_text_that_json_allows_inside_a_string_stays_in_its_row() -> None:
    # U+2028 and U+0085 are line breaks to str.splitlines, but legal inside a JSON string.
    completion = "one\u2028two\x85three"
    line = json.dumps({"prompt": "p", "completion": completion}, ensure_ascii=False)
    dataset = parse(line, GOOD)
    assert [(row.line, row.completion) for row in dataset.rows] == [(1, completion), (2, "cba")]


def test_non_utf8_files_are_refused_and_a_utf8_byte_order_mark_is_accepted() -> None:
    with pytest.raises(DatasetError, match=rf"^{SOURCE}: not UTF-8 text .*save the file as UTF-8"):
        parse_jsonl('{"prompt": "caf\u00e9=", "completion": "x"}\n'.encode("latin-1"), SOURCE)
    dataset = parse_jsonl(b"\xef\xbb\xbf" + GOOD.encode() + b"\n", SOURCE)
    assert dataset.rows[0].prompt == "abc="


def test_digest_is_the_files_sha256() -> None:
    data = (GOOD + "\n").encode()
    assert parse_jsonl(data, SOURCE).digest == "sha256:" + hashlib.sha256(data).hexdigest()


def test_an_over_long_row_is_refused_with_both_lengths(codec: TextCodec) -> None:
    # BOS + "abc=" + "cba" + EOS is 9 tokens (one per byte).
    dataset = parse(GOOD, '{"prompt": "abcd=", "completion": "dcba"}', GOOD)
    assert [len(e.input_ids) for e in tokenize(dataset, codec, max_length=11)] == [9, 11, 9]
    with pytest.raises(
        DatasetError,
        match=rf"^{SOURCE}:2: the row is 11 tokens, longer than max_length 10; shorten it, "
        r"drop it, or raise --max-length",
    ):
        tokenize(dataset, codec, max_length=10)


def test_prompt_completion_rows_learn_exactly_the_completion_and_eos(codec: TextCodec) -> None:
    dataset = parse(
        '{"prompt": "Translate: chat=", "completion": " cat \u00e9t\u00e9 \u4e2d"}', GOOD
    )
    first, second = tokenize(dataset, codec, max_length=64)
    assert labelled_spans(first, codec) == [" cat \u00e9t\u00e9 \u4e2d</s>"]
    assert labelled_spans(second, codec) == ["cba</s>"]
    # The prompt is tokenized as a server would see it: BOS first, no loss on it.
    assert first.input_ids[: len(codec.encode("Translate: chat="))] == tuple(
        codec.encode("Translate: chat=")
    )
    assert first.input_ids[0] == codec.tokenizer.bos_token_id


def test_chat_rows_learn_exactly_the_assistant_turns(codec: TextCodec) -> None:
    messages = [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris \u00e9 \u4e2d \U0001f600"},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome"},
    ]
    (example,) = tokenize(parse(json.dumps({"messages": messages})), codec, max_length=256)
    # Each assistant turn as the chat template ends it (ChatML: <|im_end|> and a newline).
    assert labelled_spans(example, codec) == [
        "Paris \u00e9 \u4e2d \U0001f600<|im_end|>\n",
        "Rome<|im_end|>\n",
    ]
    whole = codec.tokenizer.decode(list(example.input_ids), skip_special_tokens=False)
    assert whole == codec.chat_text(messages, generation_prompt=False)
    assert "Capital of France?" in whole


def test_chat_rows_need_a_chat_template(codec: TextCodec) -> None:
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = None
    plain = TextCodec(tokenizer, None, "plain-base")
    dataset = parse('{"messages": [{"role": "user", "content": "hi"}, '
                    '{"role": "assistant", "content": "yo"}]}')  # fmt: skip
    with pytest.raises(
        DatasetError, match=rf"^{SOURCE}:1: .*plain-base has no chat template; write prompt/"
    ):
        tokenize(dataset, plain, max_length=64)


def numbered(count: int, start: int = 0) -> list[str]:
    return [json.dumps({"prompt": f"{i}=", "completion": str(i)}) for i in range(start, count)]


def contents(dataset: Dataset) -> set[str | None]:
    return {r.completion for r in dataset.rows}


def test_split_holds_out_about_the_fraction_and_keeps_file_and_line() -> None:
    dataset = parse(*numbered(2000))
    train, held = dataset.split(0.1, salt="support-bot")
    # Membership is a digest per row, so the share is binomial: 200 expected, sd 13.4.
    assert 150 <= len(held.rows) <= 250
    assert sorted(r.line for r in train.rows + held.rows) == list(range(1, 2001))
    # Rows keep their file and line, so a problem found later still names where it is.
    assert all(r.completion == str(r.line - 1) for r in held.rows)
    assert (train.source, train.digest) == (held.source, held.digest) == (SOURCE, dataset.digest)
    assert held.held_out and not train.held_out
    assert dataset.split(0.1, salt="support-bot") == (train, held)
    assert len(parse(*numbered(20)).split(0.001, salt="a")[1].rows) == 1  # at least one held out
    with pytest.raises(DatasetError, match=r"holding out 10% of 1 rows leaves none to train on"):
        parse(GOOD).split(0.1, salt="a")


def test_a_row_held_out_for_an_adapter_stays_held_out_as_its_file_changes() -> None:
    """A later release of the adapter may read the file reordered, grown or with more held out:
    no row held out before is trained on, so its gate never scores a candidate on it."""
    rows = numbered(400)
    held = contents(parse(*rows).split(0.1, salt="support-bot")[1])
    reordered = parse(*reversed(rows)).split(0.1, salt="support-bot")
    assert contents(reordered[1]) == held
    grown = parse(*rows, *numbered(800, start=400)).split(0.1, salt="support-bot")
    assert held <= contents(grown[1]) and not held & contents(grown[0])
    assert held <= contents(parse(*rows).split(0.3, salt="support-bot")[1])
    # Another adapter holds out other rows of the same file.
    assert contents(parse(*rows).split(0.1, salt="other-bot")[1]) != held


def test_copies_of_a_row_are_all_held_out_or_all_trained_on() -> None:
    rows = numbered(100)
    train, held = parse(*rows, *rows, *rows).split(0.2, salt="support-bot")
    assert len(held.rows) % 3 == 0 and not contents(train) & contents(held)


def test_a_file_on_disk_names_its_path(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(GOOD + "\n" + "{}\n")
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(path))}:2: missing field"):
        parse_jsonl(path.read_bytes(), str(path))
