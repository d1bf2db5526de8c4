"""The Tinker API's built-in losses, per datum, on the log-probabilities of its target tokens.

All tensors of a datum share the next-token alignment: position i of the input predicts
`target_tokens[i]`. Each loss is a sum over positions (never a mean), so chunks of a batch, and
batches before one optimizer step, add up to the loss of the whole (the SDK splits batches).

- `cross_entropy`: `-(logprobs * weights).sum()`; weights may be any reals, negative ones
  too (the SDK's `forward_backward_custom` sends `-dC/dlogprobs` as weights).
- `importance_sampling`: `-(exp(logprobs - sampling_logprobs) * advantages).sum()`.
- `ppo`: `-min(ratio * advantages, clip(ratio, low, high) * advantages).sum()`, with
  `clip_low_threshold` (0.8) and `clip_high_threshold` (1.2) from `loss_fn_config`.
- `cispo`: `-(stop_grad(clip(ratio, low, high)) * logprobs * advantages).sum()`: the clipped
  ratio weighs each token's log-probability and never zeroes its gradient. Its thresholds
  default to 0.0 and 4.0 (one-sided: no lower bound), not PPO's.
- `dro`: `-(logprobs * advantages - 0.5 * beta * (logprobs - sampling_logprobs) ** 2).sum()`,
  `beta` from `loss_fn_config`. Tinker documents no default for it, so it must be given.

Here `ratio` is `exp(logprobs - sampling_logprobs)`. Formulas as Tinker's documentation gives
them (tinker-docs.thinkingmachines.ai, "Loss functions"; CISPO's default thresholds from the
cookbook's tutorial 202, "Custom clipping thresholds"); each returns the per-token `logprobs`
(what the sampler's logprobs are compared with) and the datum's loss.
"""

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from mint_core.errors import ConfigurationError

PPO_CLIP = (0.8, 1.2)
"""PPO's default clip thresholds on the probability ratio (Tinker's epsilon of 0.2)."""
CISPO_CLIP = (0.0, 4.0)
"""CISPO's default clip thresholds: no lower bound, the weight capped at 4 (as MiniMax-M1 and
ScaleRL clip it); a positive lower bound keeps pushing tokens the policy has left."""


@dataclass(frozen=True)
class LossResult:
    elementwise: torch.Tensor
    """Each position's loss, shaped as the logprobs; a datum's loss is its sum, keeping the
    graph. Positions past a row's end are the caller's to mask: zero inputs do not make every
    loss zero there (`dro`'s penalty)."""
    outputs: dict[str, torch.Tensor]
    """Per-token tensors the caller gets back (detached), by name."""


Inputs = Mapping[str, torch.Tensor]
Config = Mapping[str, float | str]
LossFn = Callable[[torch.Tensor, Inputs, Config], LossResult]


def _cross_entropy(logprobs: torch.Tensor, inputs: Inputs, _: Config) -> LossResult:
    weights = inputs.get("weights")
    if weights is None:
        weights = torch.ones_like(logprobs)
    elementwise = -logprobs * weights
    return LossResult(
        elementwise, {"logprobs": logprobs.detach(), "elementwise_loss": elementwise.detach()}
    )


def _ratio(logprobs: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    return torch.exp(logprobs - inputs["logprobs"])


def _importance_sampling(logprobs: torch.Tensor, inputs: Inputs, _: Config) -> LossResult:
    elementwise = -(_ratio(logprobs, inputs) * inputs["advantages"])
    return LossResult(elementwise, {"logprobs": logprobs.detach()})


def _ppo(logprobs: torch.Tensor, inputs: Inputs, config: Config) -> LossResult:
    low, high = _ppo_clip(config)
    ratio = _ratio(logprobs, inputs)
    advantages = inputs["advantages"]
    objective = torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)
    return LossResult(-objective, {"logprobs": logprobs.detach()})


def _cispo(logprobs: torch.Tensor, inputs: Inputs, config: Config) -> LossResult:
    low, high = _cispo_clip(config)
    weight = _ratio(logprobs, inputs).clamp(low, high).detach()
    elementwise = -(weight * logprobs * inputs["advantages"])
    return LossResult(elementwise, {"logprobs": logprobs.detach()})


def _dro(logprobs: torch.Tensor, inputs: Inputs, config: Config) -> LossResult:
    beta = _beta(config)
    drift = logprobs - inputs["logprobs"]
    objective = logprobs * inputs["advantages"] - 0.5 * beta * drift.square()
    return LossResult(-objective, {"logprobs": logprobs.detach()})


def _ppo_clip(config: Config) -> tuple[float, float]:
    return _clip(config, "ppo", PPO_CLIP)


def _cispo_clip(config: Config) -> tuple[float, float]:
    return _clip(config, "cispo", CISPO_CLIP)


def _clip(config: Config, loss: str, default: tuple[float, float]) -> tuple[float, float]:
    low = _number(config, "clip_low_threshold", default[0])
    high = _number(config, "clip_high_threshold", default[1])
    if not 0 <= low <= 1 <= high:
        raise ConfigurationError(
            f"{loss} clip_low_threshold={low}, clip_high_threshold={high}: need "
            f"0 <= low <= 1 <= high (e.g. its defaults, {default[0]} and {default[1]})"
        )
    return low, high


def _beta(config: Config) -> float:
    if "beta" not in config:
        raise ConfigurationError(
            "loss_fn 'dro' needs loss_fn_config['beta'], the weight of its quadratic penalty "
            "(Tinker documents no default; its example is 0.05)"
        )
    beta = _number(config, "beta", 0.0)
    if not 0 <= beta < math.inf:
        raise ConfigurationError(
            f"dro beta={beta}: need a finite number >= 0 (e.g. 0.05); a negative one rewards "
            "drifting from the sampler"
        )
    return beta


def _number(config: Mapping[str, float | str], name: str, default: float) -> float:
    value = config.get(name, default)
    if isinstance(value, str):
        raise ConfigurationError(f"loss_fn_config {name}={value!r} must be a number")
    return float(value)


@dataclass(frozen=True)
class Loss:
    fn: LossFn
    required: tuple[str, ...]
    """`loss_fn_inputs` every datum must carry, besides `target_tokens`."""
    defaults: Mapping[str, float] = field(default_factory=dict)
    """The value of each optional input a datum leaves out."""
    check_config: Callable[[Config], object] = lambda config: None
    """ConfigurationError for a `loss_fn_config` it cannot run with."""


LOSSES: dict[str, Loss] = {
    "cross_entropy": Loss(_cross_entropy, (), {"weights": 1.0}),
    "importance_sampling": Loss(_importance_sampling, ("logprobs", "advantages")),
    "ppo": Loss(_ppo, ("logprobs", "advantages"), check_config=_ppo_clip),
    "cispo": Loss(_cispo, ("logprobs", "advantages"), check_config=_cispo_clip),
    "dro": Loss(_dro, ("logprobs", "advantages"), check_config=_beta),
}


def loss_named(name: str) -> Loss:
    """The loss `name`; ConfigurationError naming the supported ones otherwise."""
    try:
        return LOSSES[name]
    except KeyError:
        raise ConfigurationError(
            f"loss_fn={name!r} is not supported by mint trainer; use one of "
            f"{', '.join(LOSSES)} (or forward_backward_custom, which builds on cross_entropy)"
        ) from None


def check_inputs(loss_name: str, inputs: Mapping[str, object], index: int) -> None:
    """ConfigurationError unless datum `index` carries the inputs `loss_name` needs, and no
    other."""
    loss = loss_named(loss_name)
    for name in ("target_tokens", *loss.required):
        if name not in inputs:
            raise ConfigurationError(
                f"datum {index}: loss_fn {loss_name!r} needs loss_fn_inputs[{name!r}]"
            )
    allowed = {"target_tokens", *loss.required, *loss.defaults}
    if unknown := sorted(set(inputs) - allowed):
        raise ConfigurationError(
            f"datum {index}: loss_fn {loss_name!r} takes loss_fn_inputs {sorted(allowed)}, not "
            f"{unknown}"
        )


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) at each position (float32): `[..., vocab]`, `[...]` -> `[...]`."""
    logits = logits.float()
    picked = logits.gather(-1, targets[..., None])[..., 0]
    return picked - torch.logsumexp(logits, dim=-1)
