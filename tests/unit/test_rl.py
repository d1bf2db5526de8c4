"""GRPO's pieces on constructed figures: group advantages, the k3 KL estimate, the rewards."""

import math

import pytest
import torch

from mint_core.errors import ConfigurationError
from mint_core.model.rl import char_reward, exact_reward, group_advantages, k3_kl


def test_group_advantages_centre_and_scale_each_group() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [0.0, 0.0, 0.0, 3.0]])
    advantages = group_advantages(rewards)
    assert advantages[0].tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    assert advantages[1].tolist() == [0.0, 0.0, 0.0, 0.0]  # nothing to learn from a tie
    # Population std of (0, 0, 0, 3) is sqrt(27)/4; the lone winner gets sqrt(3).
    assert advantages[2].tolist() == pytest.approx([-1 / math.sqrt(3)] * 3 + [math.sqrt(3)])
    with pytest.raises(ConfigurationError, match="at least 2 completions"):
        group_advantages(torch.tensor([[1.0], [0.0]]))


def test_k3_kl_is_zero_on_the_reference_and_matches_its_formula() -> None:
    train = torch.tensor([-1.0, -2.0, -0.5])
    assert k3_kl(train, train).tolist() == [0.0, 0.0, 0.0]
    reference = torch.tensor([-1.5, -1.0, -0.5])
    r = reference - train
    assert k3_kl(train, reference).tolist() == pytest.approx((r.exp() - r - 1).tolist())
    assert (k3_kl(train, reference) >= 0).all()


@pytest.mark.parametrize(
    ("completion", "finished", "exact", "chars"),
    [
        ("olleh", True, 1.0, 1.0),
        ("olleh", False, 0.0, 0.0),  # cut off at the length limit
        ("ollex", True, 0.0, 0.8),
        ("oll", True, 0.0, 0.6),  # a missing tail loses its share
        ("ollehxx", True, 0.0, 5 / 7),  # so does junk after the answer
        ("hello", True, 0.0, 0.2),
        ("", True, 0.0, 0.0),
    ],
)
def test_rewards(completion: str, finished: bool, exact: float, chars: float) -> None:
    assert exact_reward("olleh", completion, finished) == exact
    assert char_reward("olleh", completion, finished) == pytest.approx(chars)
