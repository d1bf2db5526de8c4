"""Admission benchmark: do new adapters disturb the tenants already being served?

One run against a real `mlflow server` and a real worker process (admission K=1) on loopback,
MLflow run as `mint registry` runs it: its basic-auth app, the pipeline (this process) and the
worker each signed in with their own account.
Closed-loop clients keep 8 established adapters busy (one client each, `name@production`,
TGI `/generate`); their latencies are measured over a baseline window, then again while 32 new
adapters are registered and promoted (admit -> prewarm -> activate) one after another. For each
new adapter it also measures the not-ready answer (requests sent while it is queued or
prewarming) and the activation latency: from the activate step's start (the fleet has it ready,
as the prewarm step leaves it) to the first answer from the new revision to a client asking for
`name@production` all along (`activate_step_p50_s`: until the step returns, its records done).
Adapters are random LoRAs packed and exported before the baseline windows, so the measured window
holds what a release does on the serving side. Prints the figures, writes
bench/results/admission.json.

Two baselines, one after the other, before the measured window: the plain one (tenants alone)
and a fair one, where as many adapters of another base are registered and promoted in MLflow
(the same registrations, candidate aliases, stage moves, production alias moves and worker
sync nudges) but never admitted, as this worker's catalog ignores other bases. On a machine of
few cores, MLflow and the pipeline take CPU from the worker; `p95_ratio` (measured / plain)
counts that, `p95_ratio_fair` (measured / fair) isolates admission and prewarm.

    .venv/bin/python bench/admission.py                     # 8 tenants, 32 new adapters
    .venv/bin/python bench/admission.py --new 4 --window 5  # a smoke run
"""

import argparse
import dataclasses
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event as EventType
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
# Named, not made: Prefect makes it when it first writes (a mkdtemp here was a folder left
# behind by every run, used or not).
os.environ.setdefault(
    "PREFECT_HOME", os.path.join(tempfile.gettempdir(), f"mint-bench-prefect-{os.getpid()}")
)

import httpx
import psutil
from peft import LoraConfig, get_peft_model

from bench import harness
from bench.harness import percentile
from mint_core.config import MintConfig
from mint_core.model.base import BaseSource, load_base
from mint_core.model.generate import seeded
from mint_core.model.tiny import TinySpec, ensure_tiny
from mint_core.registry import Registry
from mint_core.revisions import CANDIDATE, PRODUCTION, RevisionId
from mint_core.states import Stage
from serving.http.client import WorkerClient
from serving.worker.server import start_worker
from tasks.pipeline import (
    Exported,
    activate_revision,
    admit_revision,
    export_adapter,
    freeze_adapter,
    pack_adapter,
    prewarm_revision,
    register_revision,
    rollout_lock,
)
from tasks.training import check_import

PROMPT = "admission="
OTHER_BASE = TinySpec(seed=1, pretrain_steps=0)
"""The base of the fair baseline's adapters: same shape as the served one, other weights, so
another digest. Untrained: only its identity matters, nothing generates with it."""


@dataclasses.dataclass(frozen=True)
class Prepared:
    """An adapter exported to the store, not yet registered."""

    name: str
    imported: object
    frozen: object
    exported: Exported


def prepare(config: MintConfig, name: str, folder: Path, seed: int) -> Prepared:
    base = load_base(config.base, config.home)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"])
    with seeded(seed):
        model = get_peft_model(base.model, lora)
        for parameter_name, parameter in model.named_parameters():
            if "lora_" in parameter_name:
                parameter.data.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    imported = check_import.fn(config, folder)
    frozen = freeze_adapter.fn(config, imported.path)
    packed_dir, index = pack_adapter.fn(config, frozen)
    return Prepared(name, imported, frozen, export_adapter.fn(config, packed_dir, index))


def register(config: MintConfig, prepared: Prepared) -> RevisionId:
    return register_revision.fn(
        config, prepared.name, prepared.imported, prepared.frozen, prepared.exported, "bench"
    )


def promote_elsewhere(config: MintConfig, prepared: Prepared, worker_url: str) -> None:
    """What the measured window does in MLflow for a new adapter, for one of another base:
    `register_revision`, then `admit_revision` and `activate_revision`'s registry reads and
    writes in their order, less what they ask of workers (admit, wait until ready); then the
    worker nudged to sync, as activation nudges it. The worker must admit nothing: its catalog
    skips adapters of other bases. (The pipeline's tasks themselves need a fleet, and this
    one's worker would be asked to admit.)"""
    registry = Registry(config.tracking_uri)
    revision = register(config, prepared)
    registry.aliases.point(revision, CANDIDATE)
    registry.stages.set(revision, Stage.ADMITTED)
    registry.revisions.get(revision)  # activation checks the stage
    for stage in (Stage.PREWARMING, Stage.READY):
        registry.stages.set(revision, stage, "mint", "every worker reports it ready")
    with rollout_lock(revision.adapter) as slot:  # as every alias move takes it
        registry.aliases.move(revision, PRODUCTION, "mint", "release", slot=slot)
    if CANDIDATE in registry.revisions.get(revision).aliases:
        registry.aliases.drop(revision.adapter, CANDIDATE)
    registry.stages.set(revision, Stage.ACTIVE, "mint", "release")
    admitted = WorkerClient(worker_url).sync()
    if admitted:
        raise SystemExit(f"the worker admitted {admitted} after {revision} of another base")


class FirstAnswer:
    """A client asking for `name@production` over and over from its own thread, as users
    would, from before the activate step starts: when it first gets an answer from the new
    revision is when users see it (the step nudges the workers as soon as the alias moves and
    goes on writing its records after)."""

    def __init__(self, url: str, body: dict[str, object], revision: str) -> None:
        self._url, self._body, self._revision = url, body, revision
        self._at: float | None = None
        self._thread = threading.Thread(target=self._ask, daemon=True)
        self._thread.start()

    def _ask(self) -> None:
        with httpx.Client(base_url=self._url, timeout=60) as http:
            while True:
                response = http.post("/generate", json=self._body)
                if response.headers.get("X-Mint-Revision") == self._revision:
                    self._at = time.monotonic()
                    return
                time.sleep(0.01)  # a client's pace, not a second load on the worker's cores

    def wait(self) -> float:
        """The monotonic time of the first answer from the new revision."""
        self._thread.join()
        assert self._at is not None
        return self._at


def not_ready(http: httpx.Client, body: dict[str, object]) -> float:
    """Milliseconds to a 503 'not ready' answer; AssertionError if the answer is not that."""
    started = time.monotonic()
    response = http.post("/generate", json=body)
    assert response.status_code == 503, response.text
    return (time.monotonic() - started) * 1000


def tenant_load(
    url: str,
    names: list[str],
    new_tokens: int,
    running: EventType,
    stop: EventType,
    out: "Queue[object]",
) -> None:
    """Closed-loop clients, one thread per established adapter, in a process of their own (so
    the pipeline's work in the benchmark's process does not delay their clocks). Sets `running`
    once every client has had an answer; puts (monotonic finish time, latency) samples and
    error texts on `out` when `stop` is set."""
    samples: list[tuple[float, float]] = []
    errors: list[str] = []
    answered: set[str] = set()

    def loop(name: str) -> None:
        body = {"inputs": PROMPT, "parameters": {"adapter_id": f"{name}@production",
                                                 "max_new_tokens": new_tokens}}  # fmt: skip
        with httpx.Client(base_url=url, timeout=60) as http:
            while not stop.is_set():
                started = time.monotonic()
                response = http.post("/generate", json=body)
                done = time.monotonic()
                if response.status_code != 200:
                    errors.append(f"{name}: {response.status_code} {response.text[:200]}")
                samples.append((done, done - started))
                answered.add(name)
                if len(answered) == len(names):
                    running.set()

    threads = [threading.Thread(target=loop, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    out.put((samples, errors))


class Tenants:
    """The closed-loop tenant process; latencies by the monotonic clock (system-wide)."""

    def __init__(self, url: str, names: list[str], new_tokens: int) -> None:
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        running = context.Event()
        self._out: Queue[object] = context.Queue()
        self._process = context.Process(
            target=tenant_load, args=(url, names, new_tokens, running, self._stop, self._out)
        )
        self._process.start()
        # A spawned process imports this module again (torch, PEFT): seconds on a busy machine.
        if not running.wait(timeout=300):
            self._process.kill()
            raise SystemExit("the tenant clients got no answers within 300 s")
        self.samples: list[tuple[float, float]] = []
        self.errors: list[str] = []

    def between(self, start: float, end: float) -> list[float]:
        return [latency for at, latency in self.samples if start <= at < end]

    def stop(self) -> None:
        self._stop.set()
        self.samples, self.errors = self._out.get()  # type: ignore[misc]
        self._process.join()


def main() -> None:
    parser = harness.command_line(__doc__, "admission")
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--new", type=int, default=32, help="adapters promoted under load")
    parser.add_argument("--window", type=float, default=20.0, help="baseline seconds")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--home", type=Path, default=Path(".mint"), help="base model cache")
    args = parser.parse_args()

    with harness.scratch("admission") as (work, services):
        mlflow = harness.start_registry(work / "registry", services)
        config = MintConfig(
            home=args.home.absolute(), tracking_uri=mlflow.url, admission_k=1, sync_interval_s=0.5
        )
        load_base(config.base, config.home)  # pretrained once, before any worker starts
        worker = start_worker(config, env=harness.worker_env(mlflow))
        services.append(worker)
        config = dataclasses.replace(config, worker_urls=(worker.url,))
        run(args, config, work, {"worker": worker.process.pid, "mlflow": mlflow.process.pid})


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU time each process (and its children) has used so far."""
    used = {}
    for name, pid in pids.items():
        process = psutil.Process(pid)
        tree = [process, *process.children(recursive=True)]
        used[name] = sum(sum(p.cpu_times()[:2]) for p in tree)
    used["benchmark"] = sum(psutil.Process().cpu_times()[:2])
    return used


def run(args: argparse.Namespace, config: MintConfig, work: Path, pids: dict[str, int]) -> None:
    url = config.worker_urls[0]
    tenants = [f"tenant-{n}" for n in range(args.tenants)]
    newcomers = [f"newcomer-{n:02d}" for n in range(args.new)]
    others = [f"elsewhere-{n:02d}" for n in range(args.new)]
    print(f"preparing {len(tenants)} established, {len(newcomers)} new adapters and "
          f"{len(others)} of another base")  # fmt: skip
    prepared = {
        name: prepare(config, name, work / "adapters" / name, seed)
        for seed, name in enumerate(tenants + newcomers)
    }
    other_base = BaseSource(str(ensure_tiny(OTHER_BASE, config.home / "base")))
    elsewhere = dataclasses.replace(config, base=other_base)
    seeds = range(len(prepared), len(prepared) + len(others))  # content unlike any other's
    other_prepared = [
        prepare(elsewhere, name, work / "adapters" / name, seed)
        for seed, name in zip(seeds, others, strict=True)
    ]
    for name in tenants:
        revision = register(config, prepared[name])
        admit_revision.fn(config, revision)
        with rollout_lock(name) as slot:
            activate_revision.fn(config, revision, slot=slot)

    load = Tenants(url, tenants, args.new_tokens)
    time.sleep(2.0)  # let the loop settle
    baseline_start, cpu_at_start = time.monotonic(), cpu_seconds(pids)
    time.sleep(args.window)
    baseline_end = fair_start = time.monotonic()
    cpu_at_baseline_end = cpu_seconds(pids)
    for other in other_prepared:
        promote_elsewhere(elsewhere, other, url)
    fair_end = during_start = time.monotonic()
    cpu_at_fair_end = cpu_seconds(pids)

    not_ready_ms: list[float] = []
    activation_s: list[float] = []
    activate_step_s: list[float] = []
    with httpx.Client(base_url=url, timeout=60) as http:
        for name in newcomers:
            revision = register(config, prepared[name])
            body = {"inputs": PROMPT, "parameters": {"adapter_id": str(revision),
                                                     "max_new_tokens": 2}}  # fmt: skip
            for _ in range(5):  # registered, not ready here: the gate answers at once
                not_ready_ms.append(not_ready(http, body))
            fleet = admit_revision.fn(config, revision)
            while True:  # and while it is queued or prewarming
                try:
                    not_ready_ms.append(not_ready(http, body))
                except AssertionError:
                    break
            # As a roll-out does (`flows.rollout`): the prewarm step records the stages and waits
            # until the fleet has it ready; the activate step gets the fleet admit worked out.
            prewarm_revision.fn(config, revision, timeout_s=300, fleet=fleet)
            body["parameters"]["adapter_id"] = f"{name}@production"
            answered = FirstAnswer(url, body, str(revision))
            with rollout_lock(name) as slot:  # taken before the clock starts, as before
                moved = time.monotonic()
                activate_revision.fn(config, revision, fleet=fleet, slot=slot)
                activate_step_s.append(time.monotonic() - moved)
            activation_s.append(answered.wait() - moved)
    during_end = time.monotonic()
    cpu_at_end = cpu_seconds(pids)
    load.stop()
    # Share of one core each process used in each window: what competes with the worker.
    cores = {
        window: {name: round((end[name] - start[name]) / seconds, 3) for name in start}
        for window, start, end, seconds in (
            ("baseline", cpu_at_start, cpu_at_baseline_end, baseline_end - baseline_start),
            ("fair_baseline", cpu_at_baseline_end, cpu_at_fair_end, fair_end - fair_start),
            ("during", cpu_at_fair_end, cpu_at_end, during_end - during_start),
        )
    }

    baseline = load.between(baseline_start, baseline_end)
    fair = load.between(fair_start, fair_end)
    during = load.between(during_start, during_end)
    health = WorkerClient(url).health()
    result = {
        "tenants": args.tenants,
        "new_adapters": args.new,
        "new_tokens": args.new_tokens,
        "baseline_requests": len(baseline),
        "fair_baseline_requests": len(fair),
        "during_requests": len(during),
        "fair_baseline_s": fair_end - fair_start,
        "during_s": during_end - during_start,
        "p50_baseline_s": statistics.median(baseline),
        "p95_baseline_s": percentile(baseline, 0.95),
        "p50_fair_baseline_s": statistics.median(fair),
        "p95_fair_baseline_s": percentile(fair, 0.95),
        "p50_during_s": statistics.median(during),
        "p95_during_s": percentile(during, 0.95),
        "p95_ratio": percentile(during, 0.95) / percentile(baseline, 0.95),
        "p95_ratio_fair": percentile(during, 0.95) / percentile(fair, 0.95),
        "request_path_loads": health["request_path_loads"],
        "activation_p50_s": statistics.median(activation_s),
        "activation_max_s": max(activation_s),
        "activation_samples_s": activation_s,
        "activate_step_p50_s": statistics.median(activate_step_s),
        "not_ready_answers": len(not_ready_ms),
        "not_ready_p50_ms": statistics.median(not_ready_ms) if not_ready_ms else None,
        "not_ready_p99_ms": percentile(not_ready_ms, 0.99) if not_ready_ms else None,
        "tenant_errors": len(load.errors),
        "cores_used": cores,
        "machine_cores": os.cpu_count(),
    }
    for key, value in result.items():
        print(f"  {key:<22} {value:.4g}" if isinstance(value, float) else f"  {key:<22} {value}")
    if load.errors:
        print("tenant errors:", *load.errors[:5], sep="\n  ")
    harness.write(args.out, result)


if __name__ == "__main__":
    main()
