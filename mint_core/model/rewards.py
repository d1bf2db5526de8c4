"""How a GRPO step scores a sampled completion against its prompt's answer: all or nothing, or
the share of right characters (a denser signal to start from)."""

from collections.abc import Callable
from enum import StrEnum

from mint_core.errors import ConfigurationError


def exact_reward(answer: str, completion: str, finished: bool) -> float:
    """1.0 when the completion ended by itself and is exactly the answer, else 0.0."""
    return float(finished and completion == answer)


def char_reward(answer: str, completion: str, finished: bool) -> float:
    """The share of positions where the completion has the answer's character, over the longer
    of the two (so a right prefix followed by junk, or a missing tail, loses what it should);
    0.0 for a completion cut off at the length limit."""
    if not finished:
        return 0.0
    longest = max(len(answer), len(completion))
    if not longest:
        return 1.0
    return sum(a == c for a, c in zip(answer, completion, strict=False)) / longest


class Reward(StrEnum):
    """How a completion is scored against its prompt's answer."""

    EXACT = "exact"
    """`exact_reward`: all or nothing."""
    CHARS = "chars"
    """`char_reward`: the share of right characters, a denser signal to start from."""

    @classmethod
    def parse(cls, name: str) -> "Reward":
        try:
            return cls(name)
        except ValueError:
            known = ", ".join(reward.value for reward in cls)
            raise ConfigurationError(f"unknown reward {name!r}; known rewards: {known}") from None

    @property
    def score(self) -> Callable[[str, str, bool], float]:
        return exact_reward if self is Reward.EXACT else char_reward
