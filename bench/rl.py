"""GRPO benchmark: the `rl` flow, run for real, teaches the tiny MoE base a task it cannot do.

The base is a tiny Qwen3-MoE pretrained only on `echo` (`TinySpec(num_experts=...)`): asked to
reverse a word it echoes it, 0% exact. GRPO cannot start from there: a completion that is
right is a chance the base gives about 1e-3 per letter, so no group ever holds one and every
advantage is zero (measured: 60 steps on a zero LoRA stayed at 0-3% exact on three seeds, with
the character-level reward too). So, as RL on language models does, each seed starts from a
brief SFT: `release` trains `--sft-steps` steps on generated JSONL and ships it as `r1`, which
reverses a few words in a hundred. Then the `rl` flow runs against a real MLflow server and a
worker serving the base: `start=<adapter>:r1`, each step samples `--group` completions of
`--prompts` fresh words from `<adapter>@rl` at temperature 1 with log-probabilities and routes,
rewards exact answers, and steps with the routes replayed and the IcePop mask; every
`--sync-every` steps the adapter ships as a new revision and `rl` moves to it.

Reported per seed: the held-out words' mean exact reward of `--eval-samples` sampled completions
each, for the base, the SFT start and the last RL revision (all three sampled by the worker);
the training batches' exact reward per step from the run's MLflow metrics, and the first step
whose batch reached 60%. Written to bench/results/rl.json.

    .venv/bin/python bench/rl.py                       # 2 seeds, the recipe below
    .venv/bin/python bench/rl.py --seeds 0 --steps 40  # shorter
"""

import argparse
import dataclasses
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
# Named, not made: Prefect makes it when it first writes (a mkdtemp here was a folder left
# behind by every run, used or not).
os.environ.setdefault(
    "PREFECT_HOME", os.path.join(tempfile.gettempdir(), f"mint-bench-prefect-{os.getpid()}")
)
# The worker (which inherits these) and the trainer share 2 cores: one thread each, waiting
# passively, or the MoE forward's many small ops stall on each other's spinning threads.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from mlflow import MlflowClient

from bench import harness
from control.services import start_prefect
from flows.release import release
from flows.rl import RL_ALIAS, rl
from mint_core.config import MintConfig
from mint_core.model.base import BaseSource, load_text
from mint_core.model.rl import evaluate_sampled, held_out_prompts, task_prompts
from mint_core.model.tiny import TinySpec, ensure_tiny
from mint_core.model.toy import Task, write_jsonl
from serving.http.client import WorkerClient
from serving.worker.server import start_worker
from tasks.rl import WorkerSampler

BASE = TinySpec(hidden_size=64, num_layers=2, intermediate_size=64, num_experts=8)
"""2 layers of 8 experts (top 2), echo-pretrained in ~15 s on one thread."""
TARGET = 0.6


def run(args: argparse.Namespace, config: MintConfig, seed: int, work: Path) -> dict[str, Any]:
    adapter = f"rl-bench-s{seed}"
    task = Task.parse(args.task)
    sft_rows = task_prompts(task, seed + 1000, args.max_chars)
    data = write_jsonl([next(sft_rows) for _ in range(512)], work / f"sft-{seed}.jsonl")
    started = time.perf_counter()
    release(adapter, str(data), steps=args.sft_steps, batch_size=16, learning_rate=3e-3,
            rank=8, alpha=16, seed=seed)  # fmt: skip
    sft_seconds = time.perf_counter() - started

    codec = load_text(config.base, config.home).codec
    client = WorkerClient(config.worker_urls[0], config.worker_api_key)
    held_out = held_out_prompts(task, args.max_chars)

    def held_out_exact(adapter_id: str | None) -> float:
        sampler = WorkerSampler(client, adapter_id, codec, routes=False, seed=10_000)
        return evaluate_sampled(sampler, codec, held_out, args.eval_samples)[0]

    base_exact, start_exact = held_out_exact(None), held_out_exact(f"{adapter}:r1")
    started = time.perf_counter()
    report = rl(adapter, task=task.value, steps=args.steps, prompts=args.prompts,
                group=args.group, sync_every=args.sync_every, max_chars=args.max_chars,
                learning_rate=args.lr, reward="exact", seed=seed,
                start=f"{adapter}:r1")  # fmt: skip
    rl_seconds = time.perf_counter() - started
    after_exact = held_out_exact(f"{adapter}@{RL_ALIAS}")

    mlflow = MlflowClient(config.tracking_uri)
    curves = {
        name: [m.value for m in sorted(mlflow.get_metric_history(report.run_id, name),
                                       key=lambda m: m.step)]
        for name in ("reward_exact", "masked_fraction", "flip_rate", "kl")
    }  # fmt: skip
    curve = curves["reward_exact"]
    reached = next((i + 1 for i, v in enumerate(curve) if v >= TARGET), None)
    tail = curve[-args.tail :]
    print(
        f"seed {seed}: held-out exact base {base_exact:.3f}, SFT start {start_exact:.3f}, "
        f"after RL {after_exact:.3f}; train exact first {args.tail} steps "
        f"{sum(curve[: args.tail]) / args.tail:.3f}, last {args.tail} "
        f"{sum(tail) / len(tail):.3f}; first step >= {TARGET}: {reached}; "
        f"{len(report.revisions)} revisions; RL {rl_seconds:.0f} s; mean masked fraction "
        f"{_mean(curves['masked_fraction']):.4f}, mean flip rate {_mean(curves['flip_rate']):.4f}",
        flush=True,
    )
    return {
        "seed": seed,
        "adapter": adapter,
        "held_out_exact_base": base_exact,
        "held_out_exact_start": start_exact,
        "held_out_exact_after": after_exact,
        "train_exact_first": sum(curve[: args.tail]) / args.tail,
        "train_exact_last": sum(tail) / len(tail),
        "first_step_at_target": reached,
        "revisions": list(report.revisions),
        "mlflow_run": report.run_id,
        "sft_seconds": sft_seconds,
        "rl_seconds": rl_seconds,
        "stage_seconds": report.stage_seconds,
        "mean_masked_fraction": _mean(curves["masked_fraction"]),
        "mean_flip_rate": _mean(curves["flip_rate"]),
        "curves": curves,
    }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def main() -> None:
    parser = harness.command_line(__doc__, "rl")
    parser.add_argument("--task", default=Task.REVERSE.value)
    parser.add_argument("--max-chars", type=int, default=4, help="longest word")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--sft-steps", type=int, default=50, help="steps of the SFT start")
    parser.add_argument("--steps", type=int, default=300, help="GRPO steps")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step (P)")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--sync-every", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-samples", type=int, default=8)
    parser.add_argument("--tail", type=int, default=10, help="steps averaged for a figure")
    parser.add_argument("--home", type=Path, default=Path.home() / ".cache" / "mint-bench")
    args = parser.parse_args()

    started = time.perf_counter()
    folder = ensure_tiny(BASE, args.home / "base")
    base_seconds = time.perf_counter() - started
    with harness.scratch("rl") as (work, services):
        # A Prefect server of its own: the ephemeral one Prefect starts on demand gives up after
        # 20 s on a loaded machine.
        prefect = start_prefect(work / "prefect")
        services.append(prefect)
        os.environ["PREFECT_API_URL"] = f"{prefect.url}/api"
        mlflow = harness.start_registry(work / "registry", services)
        config = MintConfig(
            home=work / "home", tracking_uri=mlflow.url, base=BaseSource(str(folder)),
            sync_interval_s=0.5,
        )  # fmt: skip
        worker = start_worker(config, env=harness.worker_env(mlflow))
        services.append(worker)
        config = dataclasses.replace(config, worker_urls=(worker.url,))
        os.environ.update(config.to_env())  # the flows read their configuration from it
        runs = [run(args, config, seed, work) for seed in args.seeds]
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    result = {
        "base": dataclasses.asdict(BASE) | {"build_seconds": base_seconds},
        "settings": settings,
        "machine": platform.processor() or platform.machine(),
        "runs": runs,
    }
    harness.write(args.out, result)


if __name__ == "__main__":
    main()
