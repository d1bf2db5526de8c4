"""How each row of a batch picks its next token: greedy, or sampled with temperature, top-k,
top-p and a per-request seed; and when a row stops.

Every request carries its own parameters and its own random generator, so a seeded request
gives the same tokens whatever else shares its batch.
"""

import secrets
from dataclasses import dataclass

import torch

from mint_core.errors import ConfigurationError

MAX_STOP_SEQUENCES = 4
MIN_TEMPERATURE = 1e-2
"""Lower sampling temperatures are taken as this one (vLLM clamps the same way)."""


@dataclass(frozen=True)
class SamplingParams:
    """One request's decoding parameters (TGI's and OpenAI's common subset)."""

    max_new_tokens: int = 20
    temperature: float = 0.0
    """0 decodes greedily; above 0 samples from the softmax of logits / temperature."""
    top_k: int | None = None
    """Sample only among the k most likely tokens."""
    top_p: float | None = None
    """Sample only among the most likely tokens whose probabilities sum to top_p."""
    seed: int | None = None
    """Seed of this request's generator; None draws one (reported back)."""
    stop: tuple[str, ...] = ()
    """The generation ends once its text ends with any of these."""
    stop_token_ids: tuple[int, ...] | None = None
    """The generation ends at any of these tokens; None: at the base's end-of-sequence ids,
    () at none of them (it runs to max_new_tokens or a stop string)."""
    return_routes: bool = False
    """Also return, with each token, the experts every MoE layer routed it to (R3: an RL
    trainer replays them); only an embedded worker on an MoE base can."""

    def __post_init__(self) -> None:
        checks = [
            (self.max_new_tokens >= 1, f"max_new_tokens={self.max_new_tokens} must be >= 1"),
            (self.temperature >= 0, f"temperature={self.temperature} must be >= 0"),
            (self.top_k is None or self.top_k >= 1, f"top_k={self.top_k} must be >= 1"),
            (
                self.top_p is None or 0 < self.top_p <= 1,
                f"top_p={self.top_p} must be in (0, 1]",
            ),
            (
                len(self.stop) <= MAX_STOP_SEQUENCES and all(self.stop),
                f"stop={list(self.stop)} must be at most {MAX_STOP_SEQUENCES} non-empty strings",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigurationError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class RowSampler:
    """Picks one row's tokens under its parameters."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._generator = torch.Generator().manual_seed(self.seed)

    def pick(self, logits: torch.Tensor) -> tuple[int, float]:
        """The next token from one row's `[vocab]` logits, and its log-probability under the
        model (before temperature and truncation)."""
        logits = logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
        if self.params.greedy:
            token = int(torch.argmax(logits))
        else:
            # As vLLM does: below MIN_TEMPERATURE, logits / temperature overflows float32.
            temperature = max(self.params.temperature, MIN_TEMPERATURE)
            probs = torch.softmax(self._truncate(logits / temperature), dim=-1)
            token = int(torch.multinomial(probs.cpu(), 1, generator=self._generator))
        return token, float(logprobs[token])

    def _truncate(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits outside top-k and top-p set to -inf."""
        if self.params.top_k is not None and self.params.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.params.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.params.top_p is not None and self.params.top_p < 1:
            ordered, order = torch.sort(logits, descending=True)
            cumulative = torch.softmax(ordered, dim=-1).cumsum(-1)
            # Keep each token whose predecessors sum to less than top_p (the first always).
            drop = cumulative - torch.softmax(ordered, dim=-1) >= self.params.top_p
            drop[0] = False  # a top_p below float32's resolution would drop it too
            logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
        return logits


def stop_hit(text: str, stop: tuple[str, ...]) -> str | None:
    """The stop sequence `text` ends with, if any."""
    return next((s for s in stop if text.endswith(s)), None)
