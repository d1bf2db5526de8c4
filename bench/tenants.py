"""Tenants benchmark: N tenants training LoRAs on one `mint trainer` against N separate trainings.

For each N, the same supervised loop (`--steps` steps of `--batch` rows of the toy `upper`
task; each step a cross-entropy forward/backward and an AdamW step at `--lr`; tenant i draws
its rows from `training_stream(upper, seed=i)`) runs in two modes, side by side in one run:

- shared: one `mint trainer` process holds the base; N client processes (the real `tinker`
  SDK, no base loaded) each create a rank-`--rank` LoRA on it and drive their loop at once.
  Memory is the trainer's peak RSS (children included).
- separate: N processes each load the base for training and train their own LoRA with PEFT,
  as MinT's release path does (`mint_core.model.training`), with what the trainer does by
  default: LoRA on attention, MLP and lm_head, alpha 32, AdamW (0.9, 0.95, eps 1e-12, no
  weight decay), the same weighted cross-entropy summed over target tokens, one optimizer step
  per batch. Memory is the sum of the processes' peak RSS.

Every process gets its data tokenized and its model built before the clock: the clock runs from
one "go" sent to all N at once to the last one's last step. Throughput is the input tokens of
every row sent (all tenants) over that wall time. RSS is sampled every 50 ms from each process's
start. Cores: the trainer gets OpenMP/MKL threads = the machine's cores (it is the only process
computing); a separate process gets max(1, cores // N) (their total equals the cores up to N =
cores; beyond, one thread is the fewest a process can have and the OS time-slices them). Every
process runs with `OMP_WAIT_POLICY=PASSIVE` (idle OpenMP threads do not spin); the SDK clients
get one thread. Runs alternate which mode goes first; the table is medians over `--runs`.

    .venv/bin/python bench/tenants.py                                # N = 1, 4, 8; 3 runs
    .venv/bin/python bench/tenants.py --tenants 2 --steps 3 --runs 1 # a smoke run
"""

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TINKER_TELEMETRY", "0")

from bench import harness
from mint_core.config import MintConfig
from mint_core.model.base import BaseSource
from mint_core.model.toy import Task, training_stream

ROOT = Path(__file__).resolve().parents[1]
TASK = Task.UPPER
ALPHA = 32
"""The trainer's LoRA alpha (`trainer.lora.ALPHA`), used by the separate processes too."""
BETAS = (0.9, 0.95)
EPS = 1e-12
"""The Tinker SDK's `AdamParams` defaults, which the trainer applies."""
SAMPLE_S = 0.05
MODES = ("shared", "separate")

Row = dict[str, Any]
Example = tuple[list[int], list[int], list[float]]
"""One training row: input tokens, target tokens, per-target weights (0 on the prompt)."""


# The child processes.


def examples(tokenizer: Any, seed: int, steps: int, batch: int) -> list[list[Example]]:
    """`steps` batches of the tenant's rows, tokenized the way the trainer's clients do: prompt
    with BOS, answer then EOS, the loss on the answer only."""
    stream = training_stream(TASK, seed)
    batches = []
    for _ in range(steps):
        rows = []
        for _ in range(batch):
            example = next(stream)
            prompt = list(tokenizer(example.prompt, add_special_tokens=True)["input_ids"])
            answer = list(tokenizer(example.completion, add_special_tokens=False)["input_ids"])
            full = prompt + answer + [tokenizer.eos_token_id]
            weights = [0.0] * (len(prompt) - 1) + [1.0] * (len(answer) + 1)
            rows.append((full[:-1], full[1:], weights))
        batches.append(rows)
    return batches


def count(batches: Sequence[Sequence[Example]]) -> tuple[int, float]:
    """(input tokens, weighted target tokens) of the batches."""
    return (
        sum(len(tokens) for rows in batches for tokens, _, _ in rows),
        sum(sum(weights) for rows in batches for _, _, weights in rows),
    )


def handshake(out: TextIO, ready: Row) -> None:
    """Say ready (with what the parent should know), then wait for the parent's go."""
    out.write(json.dumps({"ready": ready}) + "\n")
    out.flush()
    sys.stdin.readline()


def run_tenant(request: Row, out: TextIO) -> Row:
    """One tenant of the shared trainer: its own ServiceClient and LoRA, the SDK's loop."""
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=request["url"], api_key="tml-bench")
    client = service.create_lora_training_client(
        base_model=request["base"], rank=request["rank"], seed=0
    ).result()
    batches = examples(client.get_tokenizer(), request["seed"], request["steps"], request["batch"])
    datums = [
        [
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens),
                loss_fn_inputs={"target_tokens": targets, "weights": weights},
            )
            for tokens, targets, weights in rows
        ]
        for rows in batches
    ]
    handshake(out, {})
    start = time.time()
    losses = []
    for rows, step in zip(batches, datums, strict=True):
        backward = client.forward_backward(step, "cross_entropy")
        optim = client.optim_step(types.AdamParams(learning_rate=request["lr"]))
        result = backward.result()
        optim.result()
        losses.append(result.metrics["loss:sum"] / sum(sum(w) for _, _, w in rows))
    end = time.time()
    tokens, _ = count(batches)
    return {"start": start, "end": end, "tokens": tokens, "losses": losses}


def run_separate(request: Row, out: TextIO) -> Row:
    """One tenant alone: the base loaded for training in this process, its LoRA by PEFT."""
    import torch
    from peft import LoraConfig, get_peft_model

    from mint_core.model.base import load_base, servable_modules
    from mint_core.model.generate import seeded

    torch.set_num_threads(request["threads"])
    home = Path(request["home"])
    base = load_base(BaseSource(request["base"]), home, training=True)
    targets = sorted({n.rsplit(".", 1)[-1] for n in servable_modules(base.model, output=True)})
    lora = LoraConfig(
        r=request["rank"], lora_alpha=ALPHA, lora_dropout=0.0, target_modules=targets,
        task_type="CAUSAL_LM",
    )  # fmt: skip
    with seeded(0):
        model = get_peft_model(base.model, lora)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trainable, lr=request["lr"], betas=BETAS, eps=EPS, weight_decay=0.0
    )
    batches = examples(base.codec.tokenizer, request["seed"], request["steps"], request["batch"])
    tensors = [_padded(rows, base.codec.pad_id) for rows in batches]
    params = sum(p.numel() for p in trainable)
    handshake(out, {"adapter_params": params, "targets": targets})
    start = time.time()
    losses = []
    for (input_ids, mask, targets_t, weights), rows in zip(tensors, batches, strict=True):
        logits = model(input_ids=input_ids, attention_mask=mask).logits
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        picked = logprobs.gather(-1, targets_t.unsqueeze(-1)).squeeze(-1)
        loss = -(picked * weights).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()) / sum(sum(w) for _, _, w in rows))
    end = time.time()
    tokens, _ = count(batches)
    return {"start": start, "end": end, "tokens": tokens, "losses": losses}


def _padded(rows: Sequence[Example], pad_id: int) -> tuple[Any, ...]:
    """A batch right-padded to its longest row, as the trainer pads its passes."""
    import torch

    longest = max(len(tokens) for tokens, _, _ in rows)
    input_ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    targets = torch.zeros((len(rows), longest), dtype=torch.long)
    weights = torch.zeros((len(rows), longest))
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, (tokens, target, weight) in enumerate(rows):
        n = len(tokens)
        input_ids[i, :n] = torch.tensor(tokens)
        targets[i, :n] = torch.tensor(target)
        weights[i, :n] = torch.tensor(weight)
        mask[i, :n] = 1
    return input_ids, mask, targets, weights


CHILDREN: dict[str, Callable[[Row, TextIO], Row]] = {
    "tenant": run_tenant,
    "separate": run_separate,
}


def child_main(request: Row) -> None:
    # The protocol goes on a copy of stdout; libraries' prints go to stderr (the child's log).
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    result = CHILDREN[request["role"]](request, out)
    out.write(json.dumps({"result": result}) + "\n")
    out.flush()


# The parent: processes, memory, the clock.


def thread_env(threads: int) -> dict[str, str]:
    return {
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "OMP_WAIT_POLICY": "PASSIVE",
        "TINKER_TELEMETRY": "0",
    }


@dataclasses.dataclass
class Child:
    name: str
    process: subprocess.Popen[str]
    log: Path

    def line(self) -> Row:
        text = self.process.stdout.readline() if self.process.stdout else ""
        if not text:
            self.process.wait(timeout=30)
            tail = self.log.read_text()[-3000:] if self.log.exists() else ""
            raise RuntimeError(f"{self.name} exited ({self.process.returncode}):\n{tail}")
        return json.loads(text)

    def go(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("go\n")
        self.process.stdin.flush()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def spawn(name: str, request: Row, threads: int, logs: Path) -> Child:
    log = logs / f"{name}.log"
    logs.mkdir(parents=True, exist_ok=True)
    with log.open("w") as err:
        process = subprocess.Popen(
            [sys.executable, __file__, "--child", json.dumps(request)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=os.environ | thread_env(threads),
        )
    return Child(name, process, log)


class Sampler:
    """Every 50 ms, the RSS of each watched process (its children included) and its CPU time;
    keeps each one's peak RSS and the peak of their sum."""

    def __init__(self) -> None:
        self.watched: dict[str, psutil.Process] = {}
        self.peaks: dict[str, int] = {}
        self.peak_total = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def watch(self, name: str, pid: int) -> None:
        with self._lock:
            self.watched[name] = psutil.Process(pid)
            self.peaks.setdefault(name, 0)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(SAMPLE_S)

    def sample(self) -> None:
        with self._lock:
            total = 0
            for name, process in self.watched.items():
                rss = tree(process, lambda p: p.memory_info().rss)
                self.peaks[name] = max(self.peaks[name], rss)
                total += rss
            self.peak_total = max(self.peak_total, total)

    def rss(self, name: str) -> int:
        with self._lock:
            return tree(self.watched[name], lambda p: p.memory_info().rss)

    def cpu_s(self, name: str) -> float:
        with self._lock:
            return tree(self.watched[name], lambda p: sum(p.cpu_times()[:2]))


def tree(process: psutil.Process, figure: Callable[[psutil.Process], float]) -> Any:
    """`figure` summed over `process` and its children (those still there)."""
    total = 0
    with contextlib.suppress(psutil.NoSuchProcess):
        for p in [process, *process.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                total += figure(p)
    return total


def race(children: Sequence[Child], sampler: Sampler, watched: Sequence[str]) -> Row:
    """Wait until every child is ready, send go to all at once, wait for every result: the
    wall time from go to the last step, the tokens, and the CPU the `watched` processes used."""
    ready = [child.line()["ready"] for child in children]
    cpu_before = {name: sampler.cpu_s(name) for name in watched}
    go = time.time()
    for child in children:
        child.go()
    results = [child.line()["result"] for child in children]
    end = max(r["end"] for r in results)
    wall = end - go
    cpu = {name: sampler.cpu_s(name) - cpu_before[name] for name in watched}
    return {
        "ready": ready,
        "results": results,
        "wall_s": wall,
        "tokens": sum(r["tokens"] for r in results),
        "cpu_cores": {name: s / wall for name, s in cpu.items()},
        "start_skew_s": max(r["start"] for r in results) - go,
    }


def case_figures(mode: str, tenants: int, raced: Row, rss_mb: float, **more: Any) -> Row:
    losses = [r["losses"] for r in raced["results"]]
    return {
        "tenants": tenants,
        "mode": mode,
        "rss_mb": round(rss_mb, 1),
        "tokens_per_s": round(raced["tokens"] / raced["wall_s"], 1),
        "wall_s": round(raced["wall_s"], 3),
        "tokens": raced["tokens"],
        "start_skew_s": round(raced["start_skew_s"], 3),
        "first_loss": round(statistics.mean(loss[0] for loss in losses), 4),
        "last_loss": round(statistics.mean(loss[-1] for loss in losses), 4),
        **more,
        "load_average_1m": os.getloadavg()[0],
    }


def run_shared(args: argparse.Namespace, tenants: int, home: Path, base: str) -> Row:
    from trainer.server import start_trainer

    config = dataclasses.replace(
        MintConfig.from_env(), home=home, base=BaseSource(base), trainer_models=max(tenants, 8)
    )
    cores = os.cpu_count() or 1
    children: list[Child] = []
    trainer = start_trainer(config, env=thread_env(cores))
    try:
        with Sampler() as sampler:
            sampler.watch("trainer", trainer.process.pid)
            time.sleep(0.5)
            idle = sampler.rss("trainer")
            for i in range(tenants):
                request = {
                    "role": "tenant", "url": trainer.url, "base": base, "seed": i,
                    "steps": args.steps, "batch": args.batch, "lr": args.lr, "rank": args.rank,
                }  # fmt: skip
                child = spawn(f"tenant-{i}", request, 1, home / "logs")
                children.append(child)
                sampler.watch(child.name, child.process.pid)
            raced = race(children, sampler, ["trainer", *(c.name for c in children)])
            with_models = sampler.rss("trainer")
            sampler.sample()
        clients = [c.name for c in children]
        return case_figures(
            "shared",
            tenants,
            raced,
            sampler.peaks["trainer"] / 2**20,
            trainer_threads=cores,
            trainer_idle_rss_mb=round(idle / 2**20, 1),
            trainer_end_rss_mb=round(with_models / 2**20, 1),
            clients_rss_mb=round(sum(sampler.peaks[c] for c in clients) / 2**20, 1),
            trainer_cpu_cores=round(raced["cpu_cores"]["trainer"], 2),
            clients_cpu_cores=round(sum(raced["cpu_cores"][c] for c in clients), 2),
        )
    finally:
        for child in children:
            child.kill()
        trainer.stop()


def run_separate_case(args: argparse.Namespace, tenants: int, home: Path, base: str) -> Row:
    cores = os.cpu_count() or 1
    threads = max(1, cores // tenants)
    children: list[Child] = []
    try:
        with Sampler() as sampler:
            for i in range(tenants):
                request = {
                    "role": "separate", "home": str(home), "base": base, "seed": i,
                    "steps": args.steps, "batch": args.batch, "lr": args.lr, "rank": args.rank,
                    "threads": threads,
                }  # fmt: skip
                child = spawn(f"separate-{i}", request, threads, home / "logs")
                children.append(child)
                sampler.watch(child.name, child.process.pid)
            raced = race(children, sampler, [c.name for c in children])
            sampler.sample()
        names = [c.name for c in children]
        return case_figures(
            "separate",
            tenants,
            raced,
            sum(sampler.peaks.values()) / 2**20,
            threads_each=threads,
            rss_each_mb=round(statistics.median(sampler.peaks.values()) / 2**20, 1),
            cpu_cores=round(sum(raced["cpu_cores"][n] for n in names), 2),
            adapter_params=raced["ready"][0]["adapter_params"],
        )
    finally:
        for child in children:
            child.kill()


CASES: dict[str, Callable[[argparse.Namespace, int, Path, str], Row]] = {
    "shared": run_shared,
    "separate": run_separate_case,
}


def summarize(cases: Sequence[Row], tenants: Sequence[int]) -> list[Row]:
    """Per (N, mode): the median of each figure over the runs."""
    summary = []
    for n in tenants:
        for mode in MODES:
            runs = [c for c in cases if c["tenants"] == n and c["mode"] == mode]
            row: Row = {"tenants": n, "mode": mode, "runs": len(runs)}
            for key, value in runs[0].items():
                if key not in row and key != "run" and isinstance(value, int | float):
                    row[key] = round(statistics.median(c[key] for c in runs), 3)
            summary.append(row)
    return summary


def ratios(summary: Sequence[Row], tenants: Sequence[int]) -> list[Row]:
    """Shared against separate at each N."""
    out = []
    for n in tenants:
        shared, separate = (
            next(r for r in summary if r["tenants"] == n and r["mode"] == m) for m in MODES
        )
        out.append(
            {
                "tenants": n,
                "throughput_ratio": round(shared["tokens_per_s"] / separate["tokens_per_s"], 2),
                "memory_ratio": round(shared["rss_mb"] / separate["rss_mb"], 3),
                "shared_rss_over_idle_per_tenant_mb": round(
                    (shared["rss_mb"] - shared["trainer_idle_rss_mb"]) / n, 1
                ),
            }
        )
    return out


def tenant_state_mb(params: int) -> float:
    """A tenant's LoRA in float32 with its gradient and AdamW's two moments."""
    return params * 4 * 4 / 2**20


def main() -> None:
    parser = harness.command_line(__doc__, "tenants")
    parser.add_argument("--tenants", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    harness.add_home(parser)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(json.loads(args.child))
        return

    cases: list[Row] = []
    base_folder = harness.default_base(args.home)
    with harness.scratch("tenants") as (work, _):
        base = str(base_folder)
        print(f"tenants: {args.tenants}, {args.steps} steps of {args.batch} rows, "
              f"rank {args.rank}, {args.runs} runs; base {base}", flush=True)  # fmt: skip
        for run in range(args.runs):
            for n in args.tenants:
                for mode in harness.alternating(run, MODES):
                    case = CASES[mode](args, n, work, base) | {"run": run}
                    cases.append(case)
                    print(f"  run {run} N={n} {mode}: {case['rss_mb']:.0f} MB, "
                          f"{case['tokens_per_s']:.0f} tokens/s, {case['wall_s']:.1f} s, "
                          f"load {case['load_average_1m']:.1f}", flush=True)  # fmt: skip
        base_id = Path(base).name

    summary = summarize(cases, args.tenants)
    compared = ratios(summary, args.tenants)
    params = next(c["adapter_params"] for c in cases if c["mode"] == "separate")
    print(f"\n  {'N':>3} {'mode':<9} {'peak RSS MB':>12} {'tokens/s':>10} {'wall s':>8}")
    for row in summary:
        print(f"  {row['tenants']:>3} {row['mode']:<9} {row['rss_mb']:>12.0f} "
              f"{row['tokens_per_s']:>10.0f} {row['wall_s']:>8.2f}")  # fmt: skip
    for row in compared:
        print(f"  N={row['tenants']}: shared/separate tokens/s {row['throughput_ratio']:.2f}x, "
              f"memory {row['memory_ratio']:.2f}x; shared RSS over the idle trainer "
              f"{row['shared_rss_over_idle_per_tenant_mb']:.1f} MB per tenant")  # fmt: skip
    print(f"  a tenant's LoRA + gradient + AdamW state: {params:,} parameters, "
          f"{tenant_state_mb(params):.1f} MB")  # fmt: skip
    harness.write(
        args.out,
        {
            "machine": harness.machine(),
            "cores": os.cpu_count(),
            "base": base_id,
            "task": TASK.value,
            "steps": args.steps,
            "batch": args.batch,
            "lr": args.lr,
            "rank": args.rank,
            "runs": args.runs,
            "adapter_params": params,
            "tenant_state_mb": round(tenant_state_mb(params), 2),
            "cases": summary,
            "ratios": compared,
            "samples": cases,
        },
    )


if __name__ == "__main__":
    main()
