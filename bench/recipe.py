"""Recipe benchmark: how far above the release test's floors the demo's training recipe lands.

The release test (tests/test_release.py) wants each demo adapter to answer its own task exactly
on >= 80% of the held-out words, the wrong adapter and the base to answer the other tasks on
(almost) none, and the base to echo. Floating-point kernels differ between CPUs and thread
counts, the base is pretrained where the tests run, and a tiny difference early in training
grows into another model: a recipe is only safe if its WORST case clears the floors.

For each torch thread count (each in a process of its own, so OpenMP is set up clean), each base
seed and each recipe, this pretrains the base, trains an adapter per task and seed on it and
evaluates it as `train_lora` does (greedy, exact match over `held_out_words()`), on its own task
and on the other adapter task. It prints min/median/max per task, over everything and per
thread count, and writes them with every single figure to bench/results/recipe.json.

    .venv/bin/python bench/recipe.py                      # the current defaults, full spread
    .venv/bin/python bench/recipe.py --recipe before:steps=200,learning_rate=3e-3 --recipe now
    .venv/bin/python bench/recipe.py --threads 2 --base-seeds 0 --seeds 0 1   # a quick look

A recipe is `name[:field=value,...]`: fields of BaseModelSpec (pretrain_steps,
pretrain_learning_rate, pretrain_batch_size) and of TrainingConfig (steps, learning_rate,
batch_size, rank, alpha) over the current defaults; a name alone is the current defaults.
Recipes with the same base fields share each pretrained base.
"""

import argparse
import copy
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from peft import PeftModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mint_core.base_model import BaseModel, BaseModelSpec, load_base
from mint_core.datasets import Task
from mint_core.training import TrainingConfig, evaluate, train_lora

RESULTS = Path(__file__).resolve().parent / "results" / "recipe.json"
ADAPTER_TASKS = (Task.UPPER, Task.REVERSE)
BASE_FIELDS = ("pretrain_steps", "pretrain_learning_rate", "pretrain_batch_size")
TRAINING_FIELDS = ("steps", "learning_rate", "batch_size", "rank", "alpha")

Row = dict[str, object]


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str
    base: dict[str, float]
    """BaseModelSpec fields that differ from the defaults."""
    training: dict[str, float]
    """TrainingConfig fields that differ from the defaults."""

    @classmethod
    def parse(cls, text: str) -> "Recipe":
        name, _, assignments = text.partition(":")
        base: dict[str, float] = {}
        training: dict[str, float] = {}
        for assignment in filter(None, assignments.split(",")):
            field, _, value = assignment.partition("=")
            if field not in BASE_FIELDS + TRAINING_FIELDS:
                known = ", ".join(BASE_FIELDS + TRAINING_FIELDS)
                raise SystemExit(f"unknown recipe field {field!r} in {text!r}; known: {known}")
            number = int(value) if value.isdigit() else float(value)
            (base if field in BASE_FIELDS else training)[field] = number
        return cls(name, base, training)

    def spec(self, seed: int) -> BaseModelSpec:
        return BaseModelSpec(seed=seed, **self.base)  # type: ignore[arg-type]

    def config(self, seed: int) -> TrainingConfig:
        return TrainingConfig(seed=seed, **self.training)  # type: ignore[arg-type]

    def fields(self) -> dict[str, object]:
        """Every field the recipe sets, defaults included, as they were when measured."""
        spec, config = self.spec(0), self.config(0)
        return {f: getattr(spec, f) for f in BASE_FIELDS} | {
            f: getattr(config, f) for f in TRAINING_FIELDS
        }


def measure_in_this_process(
    threads: int, recipes: list[Recipe], base_seeds: list[int], seeds: list[int], tasks: list[Task]
) -> dict[str, list[Row]]:
    """Every (recipe, base seed) base and every (task, seed) adapter on it, with `threads`."""
    torch.set_num_threads(threads)
    bases: list[Row] = []
    adapters: list[Row] = []
    pretrain_s: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="mint-recipe-") as workdir:
        home = Path(workdir)
        for recipe in recipes:
            for base_seed in base_seeds:
                spec = recipe.spec(base_seed)
                start = time.perf_counter()
                base = load_base(spec, home)
                # A base shared with an earlier recipe came from the cache: keep its build time.
                pretrain_s.setdefault(spec.key, round(time.perf_counter() - start, 2))
                where = {"recipe": recipe.name, "threads": threads, "base_seed": base_seed}
                row = where | {"pretrain_s": pretrain_s[spec.key]}
                row |= {task.value: evaluate(base.model, task) for task in Task}
                bases.append(row)
                print(f"  {row}", file=sys.stderr, flush=True)
                for seed in seeds:
                    for task in tasks:
                        adapter = where | train_and_evaluate(base, task, recipe.config(seed), home)
                        adapters.append(adapter)
                        print(f"    {adapter}", file=sys.stderr, flush=True)
    return {"bases": bases, "adapters": adapters}


def train_and_evaluate(base: BaseModel, task: Task, config: TrainingConfig, home: Path) -> Row:
    out = home / f"adapter-{base.spec.key}-{config.seed}-{task.value}"
    start = time.perf_counter()
    trained = train_lora(base, task, out, config)
    train_s = time.perf_counter() - start
    (other,) = set(ADAPTER_TASKS) - {task}
    model = PeftModel.from_pretrained(copy.deepcopy(base.model), out).eval()
    return {
        "seed": config.seed,
        "task": task.value,
        "accuracy": trained.eval_accuracy,
        "other_task": other.value,
        "other_task_accuracy": evaluate(model, other),
        "train_s": round(train_s, 2),
    }


def measure(
    threads: int, recipes: list[Recipe], base_seeds: list[int], seeds: list[int], tasks: list[Task]
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
        "recipes": [dataclasses.asdict(recipe) for recipe in recipes],
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
    tasks = [task for task in ADAPTER_TASKS if any(row["task"] == task for row in adapters)]
    summary = {}
    for scope, counts in scopes.items():
        rows = [row for row in adapters if row["threads"] in counts]
        base_rows = [row for row in bases if row["threads"] in counts]
        figures = {}
        for task in tasks:
            own = [row for row in rows if row["task"] == task]
            figures[f"{task}_adapter"] = spread([row["accuracy"] for row in own])
            figures[f"{task}_adapter_on_other_task"] = spread(
                [row["other_task_accuracy"] for row in own]
            )
        for task in Task:
            figures[f"base_on_{task}"] = spread([row[task.value] for row in base_rows])
        figures["train_s"] = spread([row["train_s"] for row in rows])
        figures["pretrain_s"] = spread([row["pretrain_s"] for row in base_rows])
        summary[scope] = figures
    return summary


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--recipe", action="append", help="name[:field=value,...], repeatable")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--base-seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--tasks", type=Task, nargs="+", default=list(ADAPTER_TASKS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        request = json.loads(args.child)
        request["recipes"] = [Recipe(**recipe) for recipe in request["recipes"]]
        request["tasks"] = [Task(task) for task in request["tasks"]]
        print(json.dumps(measure_in_this_process(**request)))
        return

    recipes = [Recipe.parse(text) for text in args.recipe or ["default"]]
    for recipe in recipes:
        print(f"recipe {recipe.name}: {recipe.fields()}", flush=True)
    bases: list[Row] = []
    adapters: list[Row] = []
    for threads in args.threads:
        measured = measure(threads, recipes, args.base_seeds, args.seeds, args.tasks)
        bases += measured["bases"]
        adapters += measured["adapters"]

    results = {}
    for recipe in recipes:
        mine = [row for row in bases if row["recipe"] == recipe.name]
        trained = [row for row in adapters if row["recipe"] == recipe.name]
        summary = summarize(mine, trained)
        print(f"\nrecipe {recipe.name}: {recipe.fields()}")
        print(f"  {'min / median / max':<30}" + "".join(f"{s:>24}" for s in summary))
        for figure in summary["all"]:
            cells = (summary[scope][figure] for scope in summary)
            print(
                f"  {figure:<30}"
                + "".join(f"{c['min']:8.3f}{c['median']:8.3f}{c['max']:8.3f}" for c in cells)
            )
        results[recipe.name] = {
            "fields": recipe.fields(),
            "summary": summary,
            "bases": mine,
            "adapters": trained,
        }

    result = {
        "machine": {"cpu": cpu_name(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "threads": args.threads,
        "base_seeds": args.base_seeds,
        "seeds": args.seeds,
        "recipes": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
