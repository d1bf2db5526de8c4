"""The rl flow's policy update on 2 processes (torchrun, gloo on CPU) takes the step 1 process
takes: on fixed groups built by hand (no sampler), on a tiny MoE base with routes replayed, the
LoRA after 3 GRPO steps and every step's figures agree within float32 summation order."""

import math
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mint_core.model.base import BaseSource, load_base, load_text
from mint_core.model.rl import Group, GrpoConfig, GrpoTrainer, Sample
from mint_core.model.tiny import TinySpec, ensure_tiny
from mint_core.model.toy import Task, prompt_for
from tasks.rl import LaunchedTrainer, stopping

SPEC = TinySpec(
    hidden_size=32, num_layers=2, num_heads=4, intermediate_size=32, num_experts=4,
    pretrain_steps=0,
)  # fmt: skip
GRPO = GrpoConfig(learning_rate=1e-2, kl_coef=0.1, seed=3)
WORDS = ("cat", "dog", "bird", "fish", "mole")
GROUP = 3
STEPS = 3
TOLERANCE = 1e-5
"""Largest difference allowed in a LoRA weight or a figure: the ranks sum the same float32
terms in another order (measured: about 1e-7)."""


def groups(source: BaseSource, home: Path, seed: int) -> list[Group]:
    """Each word's group: its exact answer and random completions of varied lengths (so the
    ranks pad to different widths), sampler log-probabilities near the untrained base's (some
    far enough for IcePop to drop) and random valid routes."""
    codec = load_text(source, home).codec
    rng = random.Random(seed)
    made = []
    for word in WORDS:
        answer = Task.UPPER.answer(word)
        prompt_ids = tuple(codec.encode(prompt_for(word)))
        samples = []
        for i in range(GROUP):
            # The answer, a wrong word, and a wrong word cut off before its end.
            completion = codec.encode_answer(answer if i == 0 else word[: i + 1])
            completion = completion if i < 2 else completion[:-1]
            fed = len(prompt_ids) + len(completion) - 1
            logprobs = tuple(-math.log(262) + rng.uniform(-1.2, 1.2) for _ in completion)
            picks = [rng.sample(range(SPEC.num_experts), 2) for _ in range(fed * SPEC.num_layers)]
            routes = torch.tensor(picks).reshape(fed, SPEC.num_layers, 2)
            samples.append(Sample(prompt_ids, tuple(completion), logprobs, routes))
        made.append(Group(answer, tuple(samples)))
    return made


@pytest.mark.slow
def test_two_processes_take_one_process_grpo_steps(tmp_path: Path) -> None:
    home = tmp_path / "home"
    source = BaseSource(str(ensure_tiny(SPEC, home / "base")))
    steps = [groups(source, home, seed) for seed in range(STEPS)]

    one = GrpoTrainer(load_base(source, home, training=True), GRPO)
    alone = [one.step(g) for g in steps]
    one.save(tmp_path / "one")

    launched = LaunchedTrainer(source, home, GRPO, None, 2, tmp_path / "ranks")
    with stopping(launched):
        shared = [launched.step(g) for g in steps]
        launched.save(tmp_path / "two")
    assert launched._ranks.process.poll() == 0  # asked to stop, every rank ended cleanly

    assert (launched.world.size, launched.world.backend) == (2, "gloo")
    assert launched.moe and launched.target_parameters == one.target_parameters
    assert alone[-1].masked_fraction > 0 and alone[-1].kl > 0 and alone[-1].flip_rate
    for a, b in zip(alone, shared, strict=True):
        assert a.step == b.step
        for name, value in a.metrics().items():
            assert b.metrics()[name] == pytest.approx(value, abs=TOLERANCE), name
    first = load_file(tmp_path / "one" / "adapter_model.safetensors")
    second = load_file(tmp_path / "two" / "adapter_model.safetensors")
    assert first.keys() == second.keys()
    differences = {k: (first[k] - second[k]).abs().max().item() for k in first}
    print(f"LoRA max |diff| {max(differences.values()):.3g} over {len(first)} tensors")
    assert max(differences.values()) < TOLERANCE
    assert any(v.abs().max() > 0 for k, v in first.items() if "lora_B" in k)  # it did train
