"""Distributed benchmark: a release's training step on 1 and 2 processes, and on 2 hosts
(issue 37). The same training (a tiny Llama built from config, `--hidden` wide, `--layers` deep,
LoRA on the family's default targets; `--steps` steps of `--batch` rows of the toy `upper` task;
one seed) runs four ways, taking turns in each of `--reps` rounds:

- 1           `train_lora` in this process: the default path (torch's own thread count);
- 1_torchrun  one rank through `processes.torchrun.start_ranks`: the launcher's own cost;
- 2           two ranks through torchrun on this host, gloo over loopback (each rank gets
              its share of the cores; the one-process cases keep torch's own count);
- 2_hosts     a rank on each of two hosts (network namespaces on a bridge, as the test cluster
              makes them; needs root), gloo over their own addresses (eth0).

Tokens are label tokens (what the loss is taken over, what `num_items_in_batch` divides by):
tokens/s is steps 2..N's over the first `step` event to the last (rank 0's `started` comes
while other ranks may still load: step 1's all-reduce waits for them). Wall time: launch to
result, process start, scoring and saving included. The all-reduce's share: rank 0's summed
gradient all-reduce time (waits for the slower rank included) over started -> last step;
`allreduce_alone_*` times all-reduces of the LoRA's size alone on the same two ranks (a barrier
first: no waiting). `equal_within`: the largest |difference| of a LoRA tensor between 1 and 2
processes. Writes bench/results/distributed.json and distributed.png.

    sudo .venv/bin/python bench/distributed.py                # 40 steps of 16 rows, 3 rounds
    .venv/bin/python bench/distributed.py --steps 4 --reps 1 --hidden 64 --layers 2 --batch 4
"""

import contextlib
import os
import pickle
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import harness

ROOT = Path(__file__).resolve().parents[1]
CASES = ("1", "1_torchrun", "2", "2_hosts")
ENTRY = "mint_core.model.training:train_rank"
HOSTS = ("train-a", "train-b")
PORT = 29500
"""Node 0's rendezvous port inside its namespace (nothing else listens there); + the round."""
POLL_S = 0.01
"""How often the driver reads rank 0's events here: an event's time is when it was seen."""
TIMEOUT_S = 120.0
COUNTED = (
    "label tokens: the answer tokens the loss is taken over (what num_items_in_batch divides "
    "by), every row of steps 2..N over the time from the first step event to the last (the "
    "steady part: rank 0's `started` comes before the other ranks are ready, and step 1 "
    "waits for them); tokens_per_s_from_started: every step's over started -> last step"
)
HOST_THREADS = max(1, len(os.sched_getaffinity(0)) // 2)
"""Threads of each 2_hosts rank: the two namespace hosts share this machine's cores."""
FLOOR = (
    "On these 2 shared cores one process already computes on both (torch's intra-op threads: "
    "in-process and 1_torchrun), while 2 processes get a core each (MinT's torchrun launch "
    "sets OMP_NUM_THREADS to the cores over the ranks of a node, and the two namespace hosts "
    "of 2_hosts share the same cores, so each is given half): 2 processes have the same two "
    "cores one process had, so the ideal speed-up of 2 processes over 1 here is ~1x, less "
    "the all-reduce and the wait for the slower rank. Where the cores are shared with other "
    "work, threads of one process wait for each other at every parallel region, so one "
    "thread per process can beat two by far more than 1x (see the samples' load). The "
    "all-reduce is a memcpy through loopback or a veth between processes on the same cores."
)
THREADS = {
    "1": "torch default (cores)",
    "1_torchrun": "torch default (cores)",
    "2": "cores / 2 per rank (MinT's torchrun launch)",
    "2_hosts": "cores / 2 per rank (the two namespace hosts share the cores)",
}
GPU = (
    "On a GPU machine each rank has its own device (torchrun --nproc-per-node = GPUs, NCCL): "
    "the step's compute is split over devices instead of shared cores, so throughput scales "
    "with the ranks up to the batch's size, and the NCCL all-reduce of the LoRA's gradients "
    "(a few MB, once per optimizer step) takes microseconds to a millisecond over NVLink "
    "(tens of ms between hosts on a slow network) against a step's tens to hundreds of ms of "
    "compute on a real base: its share stays at a few percent at most."
)


def main() -> None:
    parser = harness.command_line(__doc__, "distributed")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per training")
    parser.add_argument("--batch", type=int, default=16, help="rows per step (the global batch)")
    parser.add_argument("--reps", type=int, default=3, help="rounds of the four cases")
    parser.add_argument("--hidden", type=int, default=256, help="the tiny base's width")
    parser.add_argument("--layers", type=int, default=4, help="the tiny base's decoder layers")
    parser.add_argument("--held-out", type=int, default=8, help="held-out rows scored at the end")
    parser.add_argument("--probe-rounds", type=int, default=200,
                        help="all-reduces of the LoRA's size timed alone")  # fmt: skip
    parser.add_argument("--no-hosts", action="store_true", help="skip the 2-host case")
    args = parser.parse_args()
    load_at_start = os.getloadavg()[0]
    with harness.scratch("distributed") as (work, _):
        result = run(args, work)
    result["machine"]["load_average_1m_at_start"] = load_at_start
    report(result)
    harness.write(args.out, result)


def run(args: Any, work: Path) -> dict[str, Any]:
    """Build the base and the rows, run every case `args.reps` times, and return the JSON."""
    from mint_core.distributed import Launch
    from mint_core.model import toy
    from mint_core.model.base import BaseSource
    from mint_core.model.datasets import parse_jsonl
    from mint_core.model.tiny import TinySpec, ensure_tiny
    from mint_core.model.training import TrainingConfig, TrainJob

    spec = TinySpec(hidden_size=args.hidden, num_layers=args.layers, num_heads=4,
                    intermediate_size=2 * args.hidden, pretrain_steps=0)  # fmt: skip
    home = work / "home"
    source = BaseSource(str(ensure_tiny(spec, home / "base")))
    rows = args.steps * args.batch  # one epoch: every row trained once
    data = parse_jsonl((path := toy.write_task_data(toy.Task.UPPER, work, rows=rows)).read_bytes(),
                       str(path))  # fmt: skip
    held = parse_jsonl((path := toy.write_held_out_data(toy.Task.UPPER, work, count=args.held_out))
                       .read_bytes(), str(path))  # fmt: skip
    config = TrainingConfig(steps=args.steps, batch_size=args.batch, learning_rate=1e-3)
    counted = count_tokens(source, home, data, config)
    hosts_reason = None if not args.no_hosts else "--no-hosts"
    if hosts_reason is None:
        from tests.cluster import netns

        hosts_reason = netns.unavailable()
    cases = [c for c in CASES if c != "2_hosts" or hosts_reason is None]
    print(f"distributed: {spec.name}, {args.steps} steps of {args.batch} rows "
          f"({counted['label_tokens']} label tokens, {counted['input_tokens']} input tokens), "
          f"{args.reps} rounds of {', '.join(cases)}"
          + (f"; no 2_hosts: {hosts_reason}" if hosts_reason else ""), flush=True)  # fmt: skip

    def job(out: Path) -> TrainJob:
        return TrainJob(source, home, data, held, out, config)

    samples: list[dict[str, Any]] = []
    with hosts(work, hosts_reason is None) as cluster:
        drivers: dict[str, Callable[[Path, int], dict[str, Any]]] = {
            "1": lambda out, _: in_process(job(out)),
            "1_torchrun": lambda out, _: on_this_host(Launch(1, timeout_s=TIMEOUT_S), job(out)),
            "2": lambda out, _: on_this_host(Launch(2, timeout_s=TIMEOUT_S), job(out)),
            "2_hosts": lambda out, rep: on_two_hosts(cluster, job(out), rep),
        }
        for rep in range(args.reps):
            for case in harness.alternating(rep, cases):
                out = work / f"{case}-{rep}"
                load = os.getloadavg()[0]
                sample = drivers[case](out, rep)
                sample |= {"case": case, "rep": rep, "load_average_1m": load,
                           "tokens_per_s": counted["after_first_step"] / sample["steady_s"],
                           "tokens_per_s_from_started": counted["label_tokens"]
                                                        / sample["train_s"]}  # fmt: skip
                sample["adapter"] = str(out)
                samples.append(sample)
                print(f"  round {rep} {case:>10}: {sample['tokens_per_s']:7.0f} tokens/s, "
                      f"train {sample['train_s']:6.2f} s, wall {sample['wall_s']:6.2f} s, "
                      f"all-reduce {sample['allreduce_s']:.3f} s, load {load:.1f}",
                      flush=True)  # fmt: skip
        differences = compare(samples)
        numel = lora_numel(next(s for s in samples if s["case"] == "1"))
        alone: dict[str, list[float]] = {}
        for case in (c for c in ("2", "2_hosts") if c in cases):
            try:
                alone[case] = probe(case, cluster, work / f"probe-{case}", numel, args.probe_rounds)
            except Exception as e:  # the training's figures stand without it
                print(f"  all-reduce alone, {case}: failed: {type(e).__name__}: {e}", flush=True)
        for case, times in alone.items():
            print(f"  all-reduce alone, {case}: {numel:,} floats, median "
                  f"{1e3 * statistics.median(times):.3f} ms", flush=True)  # fmt: skip
    for sample in samples:
        del sample["adapter"]
    settings = {
        "base": asdict(spec) | {"name": spec.name},
        "task": toy.Task.UPPER.value,
        "rows": rows,
        "held_out_rows": args.held_out,
        "steps": args.steps,
        "batch": args.batch,
        "learning_rate": config.learning_rate,
        "repetitions": args.reps,
        "cases": cases,
        "skipped_2_hosts": hosts_reason,
        "timeout_s": TIMEOUT_S,
        "event_poll_s": POLL_S,
        "threads": THREADS,
    }
    settings |= {"lora_floats": numel, "probe_rounds": args.probe_rounds}
    return summarize(samples, differences, alone, counted, settings, harness.machine())


def count_tokens(source: Any, home: Path, data: Any, config: Any) -> dict[str, int]:
    """The label tokens (what the loss is taken over) and input tokens of every row the
    training's `config.steps` batches draw, in the trainer's own order."""
    from mint_core.model.base import load_base
    from mint_core.model.datasets import tokenize
    from mint_core.model.training import _batches, _label_count  # the trainer's own order

    base = load_base(source, home)
    rows = tokenize(data, base.codec, base.context_length)
    batches = _batches(rows, config.batch_size, config.seed)
    per_step = [next(batches) for _ in range(config.steps)]
    drawn = [row for step in per_step for row in step]
    return {
        "label_tokens": sum(_label_count(r) for r in drawn),
        "input_tokens": sum(len(r.input_ids) for r in drawn),
        "after_first_step": sum(_label_count(r) for step in per_step[1:] for r in step),
    }


class Stamps:
    """When each event was seen (perf_counter), from the launch."""

    def __init__(self) -> None:
        self.launched = time.perf_counter()
        self.started: float | None = None
        self.steps: list[float] = []
        self.allreduce_s = 0.0
        self.losses: list[float] = []

    def event(self, event: Mapping[str, object]) -> None:
        now = time.perf_counter()
        if "started" in event:
            self.started = now
        elif "step" in event:
            self.steps.append(now)
            self.losses.append(float(event["loss"]))  # type: ignore[arg-type]
        elif "allreduce_s" in event:
            self.allreduce_s = float(event["allreduce_s"])  # type: ignore[arg-type]

    def figures(self, done: float) -> dict[str, Any]:
        assert self.started is not None and self.steps, "no started or step event"
        return {
            "wall_s": done - self.launched,
            "startup_s": self.started - self.launched,
            "train_s": self.steps[-1] - self.started,
            "steady_s": self.steps[-1] - self.steps[0],
            "first_step_s": self.steps[0] - self.started,
            "finish_s": done - self.steps[-1],
            "steps": len(self.steps),
            "allreduce_s": self.allreduce_s,
            "allreduce_share": self.allreduce_s / (self.steps[-1] - self.started),
            "losses": self.losses,
        }


def in_process(job: Any) -> dict[str, Any]:
    """`train_lora` here, as a release with one process trains."""
    from mint_core.model.training import train_lora

    stamps = Stamps()
    train_lora(job.source, job.home, job.data, job.held_out, job.out_dir, job.config,
               on_step=lambda step, total, loss: stamps.event({"step": step, "loss": loss}),
               on_start=lambda config: stamps.event({"started": True}))  # fmt: skip
    return stamps.figures(time.perf_counter())


def watched(ranks: Any, stamps: Stamps) -> None:
    """Rank 0's events as they come (every POLL_S: the launcher's own loop reads them 5x less
    often), then the result; a failed launch raises as the release would."""
    while ranks.process.poll() is None:
        for event in ranks.events():
            stamps.event(event)
        time.sleep(POLL_S)
    ranks.result(stamps.event)


def on_this_host(launch: Any, job: Any) -> dict[str, Any]:
    """The launcher on this host, as a release with `--nproc-per-node` runs it."""
    from processes import free_port
    from processes.torchrun import start_ranks

    stamps = Stamps()
    run_dir = job.out_dir.with_name(job.out_dir.name + "-run")
    with start_ranks(launch, run_dir, ("127.0.0.1", free_port()), job=(ENTRY, job)) as ranks:
        watched(ranks, stamps)
    return stamps.figures(time.perf_counter())


@contextlib.contextmanager
def hosts(work: Path, wanted: bool) -> Iterator[Any]:
    """Two hosts (network namespaces on a bridge), removed on the way out; None if not wanted."""
    if not wanted:
        yield None
        return
    from tests.cluster.netns import Cluster

    with Cluster(HOSTS, work / "cluster") as cluster:
        yield cluster


def on_two_hosts(cluster: Any, job: Any, rep: int) -> dict[str, Any]:
    """The launcher on two hosts, one rank each, as a release with `--nnodes 2` runs it."""
    stamps = Stamps()
    folder = job.out_dir.with_name(job.out_dir.name + "-run")
    with two_hosts(cluster, (ENTRY, job), folder, PORT + rep) as ranks:
        watched(ranks, stamps)
        done = time.perf_counter()
    return stamps.figures(done)


@contextlib.contextmanager
def two_hosts(cluster: Any, job: tuple[str, object], folder: Path, port: int) -> Iterator[Any]:
    """torchrun on each host (`folder`-node0, -node1), node 0 on the first with the job in its
    run folder (rank 0 broadcasts it: node 1's gets none), gloo told to use eth0 (the
    namespaces share one host name, so it cannot find its address by name); node 0's Ranks.
    Both are stopped on the way out, node 1 once it has ended by itself."""
    from mint_core.distributed import HOST_ENV, JOB, TIMEOUT_ENV, Launch, write_atomic
    from processes.torchrun import Ranks, torchrun_argv

    launch = Launch(1, nnodes=2, timeout_s=TIMEOUT_S)
    master = (cluster.host(HOSTS[0]).address, port)
    started = []
    try:
        for node, host in enumerate(HOSTS):
            run_dir = folder.with_name(f"{folder.name}-node{node}")
            run_dir.mkdir(parents=True)
            if node == 0:
                write_atomic(run_dir / JOB, pickle.dumps(job))
            # The two "hosts" share this machine's cores: each gets its share, as case 2's
            # ranks do (processes.torchrun), not a whole machine's worth of threads each.
            env = {TIMEOUT_ENV: str(TIMEOUT_S), HOST_ENV: host, "GLOO_SOCKET_IFNAME": "eth0",
                   "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(HOST_THREADS)}  # fmt: skip
            argv = torchrun_argv(launch, run_dir, node, master)
            started.append((cluster.run(host, f"torchrun-{port}", argv, env=env), run_dir))
        (node0, run_dir0), (node1, _) = started
        yield Ranks(node0.process, run_dir0, node0.log_path)
        node1.process.wait(TIMEOUT_S)
    finally:
        for service, _ in started:
            service.stop()


def lora_numel(sample: Mapping[str, Any]) -> int:
    from safetensors.torch import load_file

    tensors = load_file(Path(sample["adapter"]) / "adapter_model.safetensors")
    return sum(t.numel() for t in tensors.values())


def probe(case: str, cluster: Any, run_dir: Path, numel: int, rounds: int) -> list[float]:
    """Seconds of each of `rounds` all-reduces of `numel` floats (the LoRA's gradients, as
    `Rank.all_reduce_grads` sends them) on the case's two ranks, timed alone: every rank
    waits at a barrier first, so no rank's lateness counts (the training's all-reduce time
    includes waiting for the slower rank)."""
    from mint_core.distributed import Launch
    from processes import free_port
    from processes.torchrun import start_ranks

    job = ("bench.distributed:allreduce_alone", (numel, rounds))
    if case == "2_hosts":
        with two_hosts(cluster, job, run_dir, PORT + 100) as ranks:
            return ranks.result()  # type: ignore[no-any-return]
    env = {"PYTHONPATH": str(ROOT)}
    launch = Launch(2, timeout_s=TIMEOUT_S)
    with start_ranks(launch, run_dir, ("127.0.0.1", free_port()), job=job, env=env) as ranks:
        return ranks.result()  # type: ignore[no-any-return]


def allreduce_alone(payload: tuple[int, int], rank: Any) -> list[float]:
    """A rank's side of `probe` (run by `mint_core.distributed`): rank 0's times."""
    import torch
    import torch.distributed as dist

    numel, rounds = payload
    flat = torch.ones(numel)
    times = []
    for _ in range(rounds + 5):  # the first few set up the connections
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(flat)
        times.append(time.perf_counter() - started)
    return times[5:]


def compare(samples: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each case's largest |difference| of a LoRA tensor and of a step's loss against the
    in-process training of the same round."""
    from safetensors.torch import load_file

    def tensors(sample: Mapping[str, Any]) -> dict[str, Any]:
        return load_file(Path(sample["adapter"]) / "adapter_model.safetensors")

    reference = {s["rep"]: s for s in samples if s["case"] == "1"}
    found: dict[str, dict[str, float]] = {}
    for sample in samples:
        one = reference.get(sample["rep"])
        if sample["case"] == "1" or one is None:
            continue
        a, b = tensors(one), tensors(sample)
        lora = max(float((a[k] - b[k]).abs().max()) for k in a)
        loss = max(abs(x - y) for x, y in zip(one["losses"], sample["losses"], strict=True))
        were = found.setdefault(sample["case"], {"lora": 0.0, "loss": 0.0})
        were["lora"], were["loss"] = max(were["lora"], lora), max(were["loss"], loss)
    return found


def summarize(
    samples: Sequence[Mapping[str, Any]],
    differences: Mapping[str, Mapping[str, float]],
    alone: Mapping[str, Sequence[float]],
    counted: Mapping[str, int],
    settings: Mapping[str, Any],
    machine: Mapping[str, Any],
) -> dict[str, Any]:
    """Medians per case, the ratios, the all-reduce's share, the equality, the floor."""
    cases = list(dict.fromkeys(s["case"] for s in samples))

    def median(case: str, key: str) -> float:
        return statistics.median(s[key] for s in samples if s["case"] == case)

    figures = ("tokens_per_s", "tokens_per_s_from_started", "steady_s", "wall_s", "startup_s",
               "train_s", "first_step_s", "finish_s", "allreduce_s", "allreduce_share")  # fmt: skip
    medians = {key: {c: round(median(c, key), 4) for c in cases} for key in figures}
    tokens = medians["tokens_per_s"]
    ratios = {f"{c}/1": round(tokens[c] / tokens["1"], 3) for c in cases if c != "1"}
    if "1_torchrun" in tokens:
        ratios |= {f"{c}/1_torchrun": round(tokens[c] / tokens["1_torchrun"], 3)
                   for c in cases if c.startswith("2")}  # fmt: skip
    compared = [c for c in ("2", "2_hosts") if c in differences]
    steps = settings["steps"]
    allreduce_ms = {c: round(1e3 * medians["allreduce_s"][c] / steps, 3) for c in cases}
    per_label = counted["input_tokens"] / counted["label_tokens"]
    alone_s = {c: statistics.median(times) for c, times in alone.items()}
    return {
        "tokens_per_s": tokens,
        "tokens_per_s_from_started": medians["tokens_per_s_from_started"],
        "speedup": ratios,
        "allreduce_share": medians["allreduce_share"].get("2"),
        "allreduce_share_by_case": medians["allreduce_share"],
        "allreduce_ms_per_step": allreduce_ms,
        "allreduce_alone_ms": {c: round(1e3 * v, 4) for c, v in alone_s.items()},
        "allreduce_alone_p95_ms": {
            c: round(1e3 * harness.percentile(t, 0.95), 4) for c, t in alone.items()
        },
        "allreduce_alone_share": {
            c: round(v * steps / medians["train_s"][c], 5) for c, v in alone_s.items()
        },
        "equal_within": max((differences[c]["lora"] for c in compared), default=None),
        "lora_max_abs_diff_vs_1": {c: d["lora"] for c, d in differences.items()},
        "loss_max_abs_diff_vs_1": {c: d["loss"] for c, d in differences.items()},
        "wall_s": medians["wall_s"],
        "train_s": medians["train_s"],
        "steady_s": medians["steady_s"],
        "startup_s": medians["startup_s"],
        "first_step_s": medians["first_step_s"],
        "finish_s": medians["finish_s"],
        "tokens_counted": COUNTED,
        "label_tokens_per_training": counted["label_tokens"],
        "input_tokens_per_training": counted["input_tokens"],
        "input_tokens_per_s": {c: round(tokens[c] * per_label, 1) for c in cases},
        "steps": steps,
        "rows": settings["rows"],
        "repetitions": settings["repetitions"],
        "medians_of": "each figure per case is the median over the repetitions",
        "floor": {"cores": os.cpu_count(), "here": FLOOR, "gpu": GPU},
        "settings": dict(settings),
        "machine": dict(machine),
        "samples": [{k: v for k, v in s.items() if k != "losses"} for s in samples],
    }


def report(result: Mapping[str, Any]) -> None:
    print(f"\n  {'case':>10} {'tokens/s':>9} {'train s':>8} {'wall s':>8} {'start s':>8} "
          f"{'all-reduce':>10}")  # fmt: skip
    for case, tokens in result["tokens_per_s"].items():
        print(f"  {case:>10} {tokens:9.0f} {result['train_s'][case]:8.2f} "
              f"{result['wall_s'][case]:8.2f} {result['startup_s'][case]:8.2f} "
              f"{100 * result['allreduce_share_by_case'][case]:9.1f}%")  # fmt: skip
    print("  speed-up (tokens/s): " + ", ".join(f"{k} {v:.2f}x"
                                              for k, v in result["speedup"].items()))  # fmt: skip
    print(
        f"  all-reduce share (2 processes): {result['allreduce_share']}; "
        f"LoRA equal within {result['equal_within']} (vs 1: {result['lora_max_abs_diff_vs_1']})"
    )
    print(f"  all-reduce alone (ms, median): {result['allreduce_alone_ms']}, as a share of "
          f"the training: {result['allreduce_alone_share']}")  # fmt: skip
    print(f"  floor: {result['floor']['here']}")


if __name__ == "__main__":
    main()
