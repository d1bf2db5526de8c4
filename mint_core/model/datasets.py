"""Training data: the user's JSONL file, validated whole before any training, and turned into
token ids with a loss mask.

A row is `{"prompt": ..., "completion": ...}` (loss on the completion and its end-of-sequence)
or `{"messages": [{"role": ..., "content": ...}, ...]}` (the base's chat template applied; loss
on the assistant turns only). Every problem names `FILE:LINE` and what to do, and nothing is
trained until the whole file is read.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from mint_core.artifacts.digests import sha256_bytes, sha256_json
from mint_core.errors import DatasetError
from mint_core.model.text import Message, TextCodec

if TYPE_CHECKING:
    import torch

DEFAULT_EVAL_FRACTION = 0.1
"""Share of the training rows held out when no held-out file is given."""
IGNORE = -100
"""Label of a position the loss skips (the prompt, padding)."""
ROLES = frozenset({"system", "user", "assistant", "tool"})


@dataclass(frozen=True)
class Row:
    """One example, as its file gave it."""

    line: int
    """1-based line number in its file."""
    prompt: str | None = None
    completion: str | None = None
    messages: tuple[Message, ...] | None = None

    def prompt_and_answer(self) -> tuple[tuple[Message, ...] | str, str]:
        """What a model is asked (a prompt, or the chat up to its last assistant turn) and the
        answer it should give: how a row is scored by exact match."""
        if self.messages is None:
            assert self.prompt is not None and self.completion is not None
            return self.prompt, self.completion
        last = max(i for i, m in enumerate(self.messages) if m["role"] == "assistant")
        return self.messages[:last], self.messages[last]["content"]

    def content(self) -> dict[str, object]:
        """The row as a JSONL line holds it, without where it was: what `digest` is over."""
        if self.messages is not None:
            return {"messages": [dict(m) for m in self.messages]}
        return {"prompt": self.prompt, "completion": self.completion}

    def digest(self) -> str:
        """sha256 of the row's content (not its line): how a row is known again in another
        file or release, e.g. by the evaluation gate among a revision's training rows."""
        return sha256_json(self.content())


@dataclass(frozen=True)
class Dataset:
    """A validated JSONL dataset."""

    source: str
    """Where it was read from: a path or an `s3://` URI."""
    digest: str
    """sha256 of the file's bytes: the policy record's `dataset_digest`."""
    rows: tuple[Row, ...]
    held_out: bool = False
    """These rows were held out of the file at `source` (`split`), which holds others too."""

    def describe(self, scored: int | None = None, path: bool = False) -> str:
        """Which rows these are, for a figure computed on them: "200 held-out rows of
        train.jsonl", "50 rows of eval.jsonl"; "256 of 300 ..." when a figure is on the first
        `scored` only. `path`: the whole path or URI rather than the file name."""
        total = len(self.rows)
        count = f"{scored} of {total}" if scored is not None and scored < total else str(total)
        kind = "held-out rows" if self.held_out else "rows"
        where = self.source if path else self.source.rstrip("/").rsplit("/", 1)[-1]
        return f"{count} {kind} of {where}"

    def split(self, fraction: float, salt: str) -> tuple[Dataset, Dataset]:
        """(training rows, held-out rows): about `fraction` of the rows held out, each row by a
        digest of its content salted with `salt` (the adapter's name), never by a seed. So a row
        held out once for an adapter stays held out in every later release of it from this
        file, reordered, grown or split with a larger fraction, and its copies go with it: a
        later revision never trains on the rows an earlier one is scored on. Another adapter
        holds out other rows."""
        draws = [_draw(salt, row) for row in self.rows]
        held = {i for i, draw in enumerate(draws) if draw < fraction}
        if not held:  # a small file: its lowest draw (and that row's copies), still by content
            held = {i for i, draw in enumerate(draws) if draw == min(draws)}
        if len(held) >= len(self.rows):
            raise DatasetError(
                f"{self.source}: holding out {fraction:.0%} of {len(self.rows)} rows leaves none "
                "to train on; lower --eval-fraction or give --eval-data"
            )
        train = tuple(r for i, r in enumerate(self.rows) if i not in held)
        evaluation = tuple(r for i, r in enumerate(self.rows) if i in held)
        return replace(self, rows=train), replace(self, rows=evaluation, held_out=True)


def _draw(salt: str, row: Row) -> float:
    """A number in [0, 1) fixed by `salt` and the row's content: the row is held out below the
    fraction."""
    digest = hashlib.sha256(f"{salt}\n{row.digest()}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def parse_jsonl(data: bytes, source: str) -> Dataset:
    """Every row of a JSONL file, checked; DatasetError `FILE:LINE: reason` for the first bad
    one (blank lines are skipped)."""
    try:
        text = data.decode("utf-8-sig")  # editors on Windows start UTF-8 files with a BOM
    except UnicodeDecodeError as e:
        raise DatasetError(f"{source}: not UTF-8 text ({e}); save the file as UTF-8") from e
    # Lines end at "\n" only: str.splitlines would also split at U+2028 or U+0085, which JSON
    # allows inside a string. json.loads skips the "\r" of a CRLF line.
    rows = [
        _row(line, number, source)
        for number, line in enumerate(text.split("\n"), start=1)
        if line.strip()
    ]
    if not rows:
        raise DatasetError(
            f"{source}: the file has no rows; write one JSON object per line, "
            '{"prompt": ..., "completion": ...} or {"messages": [...]}'
        )
    return Dataset(source, sha256_bytes(data), tuple(rows))


def load_datasets(
    read: Callable[[str], bytes],
    data: str,
    eval_data: str | None,
    eval_fraction: float,
    adapter: str,
) -> tuple[Dataset, Dataset]:
    """(training rows, held-out rows), each file read with `read` and checked whole:
    `eval_data` when given, else about `eval_fraction` of `data`'s rows, the same ones in every
    release of `adapter` (`Dataset.split`). What a release trains on; the CLI calls it too, so
    a bad file is refused before anything starts."""
    train = parse_jsonl(read(data), located(data))
    if eval_data:
        return train, parse_jsonl(read(eval_data), located(eval_data))
    return train.split(eval_fraction, adapter)


def located(location: str) -> str:
    """A data file's name as records keep it: absolute for a local path."""
    return location if location.startswith("s3://") else str(Path(location).expanduser().absolute())


def _row(line: str, number: int, source: str) -> Row:
    where = f"{source}:{number}"
    try:
        value = json.loads(line)
    except ValueError as e:
        raise DatasetError(f"{where}: not valid JSON ({e}); write one JSON object per line") from e
    if not isinstance(value, dict):
        raise DatasetError(f"{where}: a row must be a JSON object, not {type(value).__name__}")
    if "messages" in value:
        return Row(number, messages=_messages(value["messages"], where))
    missing = [name for name in ("prompt", "completion") if name not in value]
    if missing:
        raise DatasetError(
            f"{where}: missing field {' and '.join(repr(m) for m in missing)}; a row needs "
            "'prompt' and 'completion', or 'messages'"
        )
    for name in ("prompt", "completion"):
        if not isinstance(value[name], str):
            raise DatasetError(f"{where}: {name!r} must be a string, not {value[name]!r:.80}")
    if not value["completion"]:
        raise DatasetError(f"{where}: 'completion' is empty; there is nothing to learn")
    return Row(number, prompt=value["prompt"], completion=value["completion"])


def _messages(value: object, where: str) -> tuple[Message, ...]:
    if not isinstance(value, list) or not value:
        raise DatasetError(f"{where}: 'messages' must be a non-empty list of messages")
    messages = []
    for index, message in enumerate(value):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or message["role"] not in ROLES
            or not isinstance(message.get("content"), str)
        ):
            raise DatasetError(
                f"{where}: messages[{index}] is {message!r:.80}; each message needs 'role' "
                f"(one of {', '.join(sorted(ROLES))}) and a string 'content'"
            )
        messages.append({"role": message["role"], "content": message["content"]})
    if not any(m["role"] == "assistant" for m in messages):
        raise DatasetError(
            f"{where}: no assistant message; the loss is on assistant turns, add one"
        )
    return tuple(messages)


@dataclass(frozen=True)
class Tokenized:
    """One row as token ids, with the label of each position (IGNORE where no loss)."""

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]


def tokenize_example(codec: TextCodec, prompt: str, completion: str) -> Tokenized:
    """Prompt tokens as a server would see them, then the completion and end-of-sequence."""
    prompt_ids = codec.encode(prompt)
    answer = codec.encode_answer(completion)
    return Tokenized((*prompt_ids, *answer), (*[IGNORE] * len(prompt_ids), *answer))


def tokenize_messages(codec: TextCodec, messages: Sequence[Message], where: str) -> Tokenized:
    """The chat template over every turn; labels on the characters of assistant turns (their
    content and the template's end-of-turn), found from each turn's prefix."""
    if not codec.has_chat_template:
        raise DatasetError(
            f"{where}: a messages row needs a chat template, and the base model "
            f"{codec.model_id} has no chat template; write prompt/completion rows, or train "
            "on a base whose tokenizer_config.json has a chat_template"
        )
    text = codec.chat_text(messages, generation_prompt=False)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(codec.chat_text(messages[:index], generation_prompt=True)) if index else 0
        through = codec.chat_text(messages[: index + 1], generation_prompt=False)
        if not text.startswith(through):
            raise DatasetError(
                f"{where}: the chat template of {codec.model_id} renders a conversation's "
                "start differently from the whole, so assistant turns cannot be located; use "
                "prompt/completion rows"
            )
        spans.append((start, len(through)))
    encoded = codec.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    labels = [
        token if any(start <= begin < end for start, end in spans) else IGNORE
        for token, (begin, _) in zip(ids, encoded["offset_mapping"], strict=True)
    ]
    return Tokenized(tuple(ids), tuple(labels))


def tokenize(dataset: Dataset, codec: TextCodec, max_length: int) -> list[Tokenized]:
    """Every row tokenized; DatasetError `FILE:LINE` for a row longer than `max_length`."""
    examples = []
    for row in dataset.rows:
        where = f"{dataset.source}:{row.line}"
        if row.messages is not None:
            example = tokenize_messages(codec, row.messages, where)
        else:
            assert row.prompt is not None and row.completion is not None
            example = tokenize_example(codec, row.prompt, row.completion)
        if len(example.input_ids) > max_length:
            raise DatasetError(
                f"{where}: the row is {len(example.input_ids)} tokens, longer than max_length "
                f"{max_length}; shorten it, drop it, or raise --max-length (at most the base's "
                "context)"
            )
        if all(label == IGNORE for label in example.labels):
            raise DatasetError(f"{where}: the row has no answer tokens to learn from")
        examples.append(example)
    return examples


def collate(examples: Sequence[Tokenized], codec: TextCodec) -> dict[str, torch.Tensor]:
    """A right-padded causal-LM batch."""
    import torch

    width = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), width), codec.pad_id)
    labels = torch.full((len(examples), width), IGNORE)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, example in enumerate(examples):
        size = len(example.input_ids)
        input_ids[row, :size] = torch.tensor(example.input_ids)
        labels[row, :size] = torch.tensor(example.labels)
        attention_mask[row, :size] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
