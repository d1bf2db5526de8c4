"""Synthetic word tasks that adapters learn, generated in code from a seed.

A prompt is a word followed by `=`; the answer is the task applied to the word, then
end-of-sequence. The base model is pretrained on `echo` over lower- and upper-case words, so it
can already emit every character the other tasks need (a LoRA cannot easily teach a base to
emit tokens it never emitted).
"""

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from mint_core.errors import ConfigurationError

PROMPT_SUFFIX = "="
_LOWER = "abcdefghijklmnopqrstuvwxyz"
_MIN_LEN, _MAX_LEN = 3, 8
# Held-out words come from their own seed and are excluded from every training stream.
_HELD_OUT_SEED = 1_000_003


class Task(StrEnum):
    """A synthetic task: what the answer to `word=` is."""

    ECHO = "echo"
    """The word itself: what the base model is pretrained to do."""
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
    answer: str


def prompt_for(word: str) -> str:
    return word + PROMPT_SUFFIX


def _random_word(rng: random.Random, mixed_case: bool) -> str:
    word = "".join(rng.choice(_LOWER) for _ in range(rng.randint(_MIN_LEN, _MAX_LEN)))
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


def training_stream(task: Task, seed: int, *, mixed_case: bool = False):
    """An endless, seeded stream of training examples that avoids the held-out words."""
    rng = random.Random(seed)
    while True:
        word = _random_word(rng, mixed_case)
        if word.lower() in _HELD_OUT:
            continue
        yield Example(prompt_for(word), task.answer(word))


def dataset_digest(task: Task, seed: int, *, mixed_case: bool = False) -> str:
    """Identifies a generated dataset: the generator's inputs, which determine every example."""
    spec = f"mint-synthetic-v1|task={task.value}|seed={seed}|mixed_case={mixed_case}"
    return "sha256:" + hashlib.sha256(spec.encode()).hexdigest()
