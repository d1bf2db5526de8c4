"""The policy-gradient loss of RL on sampled completions, with IcePop's per-token mask.

The sampler (a serving worker) and the trainer compute a token's probability with different
kernels, batches and, on MoE bases, possibly different experts; where the two disagree too much
the token's gradient is noise that can make training collapse. IcePop drops, per token, the
gradient of every token whose ratio π_train / π_sample lies outside [low, high] (the reference
uses [0.5, 5.0]), instead of clipping it as PPO would.
"""

import math
from dataclasses import dataclass

import torch

from mint_core.errors import ConfigurationError

ICEPOP_LOW = 0.5
"""Default lower bound of the kept ratio π_train / π_sample."""
ICEPOP_HIGH = 5.0
"""Default upper bound of the kept ratio π_train / π_sample."""


def icepop_mask(
    train_logprobs: torch.Tensor,
    sample_logprobs: torch.Tensor,
    low: float = ICEPOP_LOW,
    high: float = ICEPOP_HIGH,
) -> torch.Tensor:
    """True where the token's ratio exp(train - sample) lies in [low, high], bounds included.

    It compares in log space, log(low) <= train - sample <= log(high), in the log-probabilities'
    dtype, so that a ratio built from log-probabilities exactly at a bound counts as inside. A
    token the sampler gave -inf (an infinite ratio), or both gave -inf (NaN), is never kept.
    """
    if not 0 < low < high:  # also refuses NaN, which compares False
        raise ConfigurationError(
            f"IcePop bounds low={low}, high={high} must satisfy 0 < low < high (e.g. 0.5, 5.0)"
        )
    if train_logprobs.shape != sample_logprobs.shape:
        raise ConfigurationError(
            f"trainer log-probabilities of shape {tuple(train_logprobs.shape)} do not match the "
            f"sampler's {tuple(sample_logprobs.shape)}"
        )
    log_ratio = train_logprobs.detach() - sample_logprobs.detach()
    return (log_ratio >= math.log(low)) & (log_ratio <= math.log(high))


@dataclass(frozen=True)
class PolicyLoss:
    """One batch's policy-gradient loss and what IcePop did to it."""

    loss: torch.Tensor
    """Scalar to minimise: minus the mean of ratio * advantage over the kept tokens."""
    masked_fraction: float
    """The share of completion tokens IcePop dropped (logged per step)."""


def masked_policy_loss(
    train_logprobs: torch.Tensor,
    sample_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    low: float = ICEPOP_LOW,
    high: float = ICEPOP_HIGH,
) -> PolicyLoss:
    """-mean(ratio * advantage) over the completion tokens IcePop keeps.

    `ratio = exp(train - sample)` with the sampler's log-probabilities constant, so its gradient
    is ratio * advantage * ∇ log π_train: the importance-weighted policy gradient for samples
    drawn from π_sample. `advantages` broadcasts against the log-probabilities (`[batch, 1]`
    for one advantage per completion); `completion_mask` marks the tokens that were sampled
    (not prompt or padding).
    """
    completion = completion_mask.bool()
    kept = icepop_mask(train_logprobs, sample_logprobs, low, high) & completion
    # Exponentiate only kept tokens: a dropped token's ratio may be inf, and inf * 0 is NaN.
    log_ratio = torch.where(kept, train_logprobs - sample_logprobs.detach(), 0.0)
    per_token = torch.exp(log_ratio) * advantages * kept
    loss = -per_token.sum() / kept.sum().clamp(min=1)
    total = int(completion.sum())
    dropped = total - int(kept.sum())
    return PolicyLoss(loss=loss, masked_fraction=dropped / total if total else 0.0)
