"""The embedded default's data: synthetic word tasks, generated in code from a seed and written
as ordinary JSONL datasets (`{"prompt": "word=", "completion": "drow"}`) that go through the
same training path as a user's file.

The tiny base is pretrained on `echo` over lower- and upper-case words, so it can already emit
every character the other tasks need (a LoRA cannot easily teach a base to emit tokens it never
emitted).
"""

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from mint_core.errors import ConfigurationError

PROMPT_SUFFIX = "="
_LOWER = "abcdefghijklmnopqrstuvwxyz"
MIN_WORD_LENGTH, MAX_WORD_LENGTH = 3, 8
"""Every generated word has this many letters or more, and no more than that many."""
# Held-out words come from their own seed and are excluded from every training stream.
_HELD_OUT_SEED = 1_000_003


class Task(StrEnum):
    """A synthetic task: what the answer to `word=` is."""

    ECHO = "echo"
    """The word itself: what the tiny base is pretrained to do."""
    UPPER = "upper"
    """The word in upper case."""
    REVERSE = "reverse"
    """The word reversed."""

    @classmethod
    def parse(cls, name: str) -> "Task":
        try:
            return cls(name)
        except ValueError:
            known = ", ".join(task.value for task in cls)
            raise ConfigurationError(f"unknown task {name!r}; known tasks: {known}") from None

    def answer(self, word: str) -> str:
        return _ANSWERS[self](word)


_ANSWERS: dict[Task, Callable[[str], str]] = {
    Task.ECHO: lambda word: word,
    Task.UPPER: str.upper,
    Task.REVERSE: lambda word: word[::-1],
}


@dataclass(frozen=True)
class Example:
    prompt: str
    completion: str


def prompt_for(word: str) -> str:
    return word + PROMPT_SUFFIX


def _random_word(rng: random.Random, mixed_case: bool) -> str:
    word = "".join(rng.choice(_LOWER) for _ in range(rng.randint(MIN_WORD_LENGTH, MAX_WORD_LENGTH)))
    if mixed_case and rng.random() < 0.5:
        word = word.upper()
    return word


def held_out_words(count: int = 64) -> list[str]:
    """Lower-case words no training stream ever yields: the evaluation set."""
    rng = random.Random(_HELD_OUT_SEED)
    words: list[str] = []
    while len(words) < count:
        word = _random_word(rng, mixed_case=False)
        if word not in words:
            words.append(word)
    return words


_HELD_OUT = frozenset(held_out_words())


def training_stream(task: Task, seed: int, *, mixed_case: bool = False) -> Iterator[Example]:
    """An endless, seeded stream of training examples that avoids the held-out words."""
    rng = random.Random(seed)
    while True:
        word = _random_word(rng, mixed_case)
        if word.lower() in _HELD_OUT:
            continue
        yield Example(prompt_for(word), task.answer(word))


def write_jsonl(examples: list[Example], path: Path) -> Path:
    """`examples` as a prompt/completion JSONL file at `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = (json.dumps({"prompt": e.prompt, "completion": e.completion}) for e in examples)
    path.write_text("".join(line + "\n" for line in lines))
    return path


def write_task_data(task: Task, folder: Path, rows: int = 12_800, seed: int = 0) -> Path:
    """A training file of `rows` generated examples of `task` (default: 400 batches of the
    recipe's 32)."""
    stream = training_stream(task, seed)
    examples = [next(stream) for _ in range(rows)]
    return write_jsonl(examples, folder / f"{task.value}-train-s{seed}-n{rows}.jsonl")


def write_held_out_data(task: Task, folder: Path, count: int = 64) -> Path:
    """The held-out words of `task` as an evaluation file."""
    examples = [Example(prompt_for(w), task.answer(w)) for w in held_out_words(count)]
    return write_jsonl(examples, folder / f"{task.value}-held-out-n{count}.jsonl")


RECIPE: dict[str, float | int] = {"learning_rate": 5e-3, "batch_size": 32, "epochs": 1.0}
"""How the demo and the tests train on these tasks (release-flow parameters): with
`write_task_data`'s 12,800 rows, one epoch is 400 steps. Measured with `bench/recipe.py` over
base seeds, seeds and thread counts (bench/results/recipe.json). Gradient clipping
(`TrainingConfig.max_grad_norm`) matters here: without it the worst run on `reverse` scored
0.48, and rank 16 over two epochs diverged twice in 18 runs (0.016)."""
