"""GRPO benchmark: how fast RL with R3 and IcePop teaches the tiny MoE base a task it cannot do.

The base is a tiny Qwen3-MoE pretrained only on `echo` (`TinySpec(num_experts=...)`), which
answers `reverse` on short words exactly almost never. Each seed starts a zero LoRA (attention
and every expert) and runs GRPO with nothing else, no SFT: each step samples `--group`
completions at temperature 1 for each of `--prompts` fresh training words (in process, routes
recorded), rewards them by the share of right characters, and takes one step with the sampler's
routes replayed and the IcePop mask. The held-out words are scored before and after, by the
mean exact reward of `--eval-samples` sampled completions each. Per-step curves and the first
step whose training batch reaches 60% exact go to bench/results/rl.json.

    .venv/bin/python bench/rl.py                       # 3 seeds, the recipe below
    .venv/bin/python bench/rl.py --seeds 0 --steps 40
"""

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mint_core.model.base import BaseSource, load_base
from mint_core.model.rl import (
    Group,
    GrpoConfig,
    GrpoTrainer,
    HfSampler,
    Reward,
    answer_budget,
    evaluate_sampled,
    held_out_prompts,
    task_prompts,
)
from mint_core.model.tiny import TinySpec, ensure_tiny
from mint_core.model.toy import Task

RESULTS = Path(__file__).resolve().parent / "results" / "rl.json"
BASE = TinySpec(hidden_size=64, num_layers=2, intermediate_size=64, num_experts=8)
"""The benchmark's base: 2 layers of 8 experts (top 2), echo-pretrained in ~15 s on 1 thread."""
TARGET = 0.6


def run(args: argparse.Namespace, seed: int, folder: Path) -> dict[str, Any]:
    base = load_base(BaseSource(name=str(folder)), args.home, training=True)
    config = GrpoConfig(
        rank=args.rank, alpha=2 * args.rank, learning_rate=args.lr, reward=args.reward, seed=seed
    )
    trainer = GrpoTrainer(base, config)
    sampler = HfSampler(trainer.model, base, seed)
    codec = base.codec
    held_out = held_out_prompts(args.task, args.max_chars)
    before = evaluate_sampled(sampler, codec, held_out, args.eval_samples)
    prompts = task_prompts(args.task, seed, args.max_chars)
    curve, reached, started = [], None, time.perf_counter()
    for _ in range(args.steps):
        groups = []
        for _ in range(args.prompts):
            example = next(prompts)
            budget = answer_budget(codec, example.completion)
            samples = sampler.sample(example.prompt, args.group, budget)
            groups.append(Group(example.completion, tuple(samples)))
        metrics = trainer.step(groups)
        curve.append(metrics.metrics())
        if reached is None and metrics.reward_exact >= TARGET:
            reached = metrics.step
        print(
            f"seed {seed} step {metrics.step:3d} exact {metrics.reward_exact:.3f} "
            f"reward {metrics.reward:.3f} kl {metrics.kl:.4f} masked {metrics.masked_fraction:.3f} "
            f"flips {metrics.flip_rate}",
            flush=True,
        )
    seconds = time.perf_counter() - started
    after = evaluate_sampled(sampler, codec, held_out, args.eval_samples)
    last = curve[-args.tail :]
    return {
        "seed": seed,
        "held_out_exact_before": before[0],
        "held_out_exact_after": after[0],
        "held_out_chars_before": before[1],
        "held_out_chars_after": after[1],
        "first_step_at_target": reached,
        "final_train_exact": sum(m["reward_exact"] for m in last) / len(last),
        "seconds": seconds,
        "curve": curve,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", type=Task.parse, default=Task.REVERSE)
    parser.add_argument("--max-chars", type=int, default=4, help="longest word")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (P)")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--reward", type=Reward, default=Reward.CHARS)
    parser.add_argument("--eval-samples", type=int, default=8)
    parser.add_argument("--tail", type=int, default=5, help="steps averaged for the final figure")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--home", type=Path, default=Path.home() / ".cache" / "mint-bench")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    folder = ensure_tiny(BASE, args.home / "base")
    base_seconds = time.perf_counter() - started
    runs = [run(args, seed, folder) for seed in args.seeds]
    for r in runs:
        print(
            f"seed {r['seed']}: held-out exact {r['held_out_exact_before']:.3f} -> "
            f"{r['held_out_exact_after']:.3f}, train exact (last {args.tail} steps) "
            f"{r['final_train_exact']:.3f}, first step >= {TARGET}: {r['first_step_at_target']}, "
            f"{r['seconds']:.0f} s"
        )
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "base": BASE.__dict__ | {"build_seconds": base_seconds},
                "settings": settings,
                "machine": platform.processor() or platform.machine(),
                "runs": runs,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
