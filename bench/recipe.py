"""Recipe benchmark: how far above the release test's floors the toy training recipe lands.

The release test wants an adapter trained on a toy task's JSONL file to answer >= 80% of the
held-out words exactly, while the base answers <= 5% of them. Floating-point kernels differ
between CPUs and thread counts, the embedded base is pretrained where the tests run, and a tiny
difference early in training grows into another model: a recipe is only safe if its WORST case
clears the floors.

For each torch thread count (each in a process of its own, so OpenMP is set up clean) and each
base seed, this builds the embedded default base (`TinySpec(seed=...)`; seed 0 is the default
itself) and scores it on every task's held-out rows. Then, for each seed and task, it trains
the way a release does: the task's generated JSONL file (`toy.write_task_data`, 12,800 rows)
through `training.train_lora` with the toy recipe (`toy.RECIPE`: learning rate 5e-3, batch 32,
rank 8, one epoch = 400 steps, gradients clipped to norm 1), held-out rows from
`toy.write_held_out_data`; accuracy is the `eval_exact_match` training reports. It prints
min/median/max per task, over everything and per thread count, and writes them with every
single figure to bench/results/recipe.json.

    .venv/bin/python bench/recipe.py                                     # the full spread
    .venv/bin/python bench/recipe.py --threads 2 --base-seeds 0 --seeds 0 --tasks reverse
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import harness
from mint_core.model.base import BaseSource, load_base
from mint_core.model.datasets import Dataset, parse_jsonl
from mint_core.model.tiny import TinySpec, ensure_tiny
from mint_core.model.toy import RECIPE, Task, write_held_out_data, write_task_data
from mint_core.model.training import TrainingConfig, exact_match, train_lora

ADAPTER_TASKS = (Task.UPPER, Task.REVERSE)

ROWS = 12_800
"""Training rows per file: with the recipe's batch of 32, one epoch is 400 steps."""

Row = dict[str, Any]


def read(path: Path) -> Dataset:
    return parse_jsonl(path.read_bytes(), str(path))


def measure_in_this_process(
    threads: int, base_seeds: list[int], seeds: list[int], tasks: list[Task]
) -> dict[str, list[Row]]:
    """Every base seed's base and every (task, seed) adapter on it, with `threads`."""
    torch.set_num_threads(threads)
    bases: list[Row] = []
    adapters: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="mint-recipe-") as workdir:
        home = Path(workdir)
        held_out = {task: read(write_held_out_data(task, home / "data")) for task in Task}
        for base_seed in base_seeds:
            start = time.perf_counter()
            folder = ensure_tiny(TinySpec(seed=base_seed), home / "base")
            where: Row = {"threads": threads, "base_seed": base_seed}
            row = where | {"pretrain_s": round(time.perf_counter() - start, 2)}
            source = BaseSource(str(folder))
            base = load_base(source, home)
            row |= {task.value: exact_match(base.model, base, held_out[task].rows) for task in Task}
            del base
            bases.append(row)
            print(f"  {row}", file=sys.stderr, flush=True)
            for seed in seeds:
                for task in tasks:
                    data = read(write_task_data(task, home / "data", ROWS, seed))
                    config = TrainingConfig(seed=seed, **RECIPE)
                    out = home / "adapters" / f"{base_seed}-{seed}-{task.value}"
                    start = time.perf_counter()
                    trained = train_lora(source, home, data, held_out[task], out, config)
                    adapter = where | {
                        "seed": seed,
                        "task": task.value,
                        "steps": trained.steps,
                        "accuracy": trained.eval_metrics["eval_exact_match"],
                        "eval_loss": round(trained.eval_metrics["eval_loss"], 4),
                        "final_loss": round(trained.losses[-1], 4),
                        "train_s": round(time.perf_counter() - start, 2),
                    }
                    adapters.append(adapter)
                    print(f"    {adapter}", file=sys.stderr, flush=True)
    return {"bases": bases, "adapters": adapters}


def measure(
    threads: int, base_seeds: list[int], seeds: list[int], tasks: list[Task]
) -> dict[str, list[Row]]:
    """`measure_in_this_process` in a fresh process whose OpenMP is sized to `threads`."""
    # Passive waiting changes no arithmetic; it stops idle OpenMP threads from spinning, which on
    # a CPU shared with other work made a two-thread run ten times slower.
    env = os.environ | {
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "OMP_WAIT_POLICY": "PASSIVE",
    }
    request = {
        "threads": threads,
        "base_seeds": base_seeds,
        "seeds": seeds,
        "tasks": [task.value for task in tasks],
    }
    done = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(request)],
        env=env,
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    return json.loads(done.stdout)


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def summarize(bases: list[Row], adapters: list[Row]) -> dict[str, dict[str, dict[str, float]]]:
    """Min/median/max of each figure the release test checks, overall and per thread count."""
    thread_counts = sorted({row["threads"] for row in bases})
    scopes = {"all": thread_counts} | {f"threads={t}": [t] for t in thread_counts}
    summary = {}
    for scope, counts in scopes.items():
        rows = [row for row in adapters if row["threads"] in counts]
        base_rows = [row for row in bases if row["threads"] in counts]
        figures = {}
        for task in sorted({row["task"] for row in rows}):
            own = [row["accuracy"] for row in rows if row["task"] == task]
            figures[f"{task}_adapter"] = spread(own)
        for task in Task:
            figures[f"base_on_{task}"] = spread([row[task.value] for row in base_rows])
        if rows:
            figures["train_s"] = spread([row["train_s"] for row in rows])
        figures["pretrain_s"] = spread([row["pretrain_s"] for row in base_rows])
        summary[scope] = figures
    return summary


def main() -> None:
    parser = harness.command_line(__doc__, "recipe")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--base-seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--tasks", type=Task.parse, nargs="+", default=list(ADAPTER_TASKS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        request = json.loads(args.child)
        request["tasks"] = [Task(task) for task in request["tasks"]]
        print(json.dumps(measure_in_this_process(**request)))
        return

    print(f"recipe: {RECIPE} over {ROWS} generated rows", flush=True)
    bases: list[Row] = []
    adapters: list[Row] = []
    for threads in args.threads:
        measured = measure(threads, args.base_seeds, args.seeds, args.tasks)
        bases += measured["bases"]
        adapters += measured["adapters"]

    summary = summarize(bases, adapters)
    print(f"  {'min / median / max':<26}" + "".join(f"{s:>24}" for s in summary))
    for figure in summary["all"]:
        cells = (summary[scope][figure] for scope in summary)
        print(
            f"  {figure:<26}"
            + "".join(f"{c['min']:8.3f}{c['median']:8.3f}{c['max']:8.3f}" for c in cells)
        )
    result = {
        "machine": {"cpu": harness.cpu_name(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "recipe": RECIPE | {"rows": ROWS},
        "threads": args.threads,
        "base_seeds": args.base_seeds,
        "seeds": args.seeds,
        "summary": summary,
        "bases": bases,
        "adapters": adapters,
    }
    harness.write(args.out, result)


if __name__ == "__main__":
    main()
