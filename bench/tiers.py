"""Tiers benchmark: 10,000 production adapters over two workers whose host tiers hold 100 each,
behind the gateway, under Zipf traffic (MinT issue 25).

One run on this machine:

- **Registration.** N adapters (default 10,000) of the embedded default base, each a rank-2
  LoRA on q/v whose tensors come from its own seed (distinct contents), taken through MinT's
  import check, freeze, pack and export into a local artifact store, by several processes. The
  MLflow side bypasses the release flow the way `bench/catalog.py` does: MLflow's client writes
  the registered model (kind and base digest tags), the version (the policy record's tags, stage
  `active`) and `production` (`registry.aliases.point`, so with the pipeline's alias intent)
  straight into the server's database, one adapter after another, while the processes make the
  next artifacts. A catalog snapshot is then published (`build_snapshot`), so workers and the
  gateway start from it rather than reading N versions over REST.
- **Services.** `mlflow server`, two workers (`MINT_HOST_ADAPTERS=100`, `MINT_DEVICE_SLOTS=16`,
  `MINT_WORKER_URLS` both, `MINT_REPLICAS=1`) and a gateway over them.
- **Main run.** 8 closed-loop clients send TGI `/generate` requests (`name@production`, 4 new
  tokens, greedy) through the gateway, adapters drawn Zipf(1.0) over the N (rank -> adapter by
  a seeded permutation). A 503 `not_ready` is retried on the same adapter after the wait it
  asks for (`Retry-After-Ms`, else `Retry-After`) until a 200. Warm-up (default 60 s, not
  counted), then the measured window (default 180 s).
- **Baseline.** After the main run, the same clients send Zipf traffic only over the revisions
  the workers report ready (`/admin/routing`), for `--baseline-s`.
- **Worker side.** Each worker's `/metrics` is read every second (host-tier occupancy, host
  evictions, loads) with its RSS; `/health` gives the request-path loads.

Figures: `hit_ratio` (measured requests answered without any 503), cold time-to-first-answer
p50/p99 (first 503 -> the 200; aims: p50 <= 1 s, p99 <= 3 s), `warm_p95_ratio` (p95 of the
measured requests answered at first try / the baseline's p95; aim <= 1.10),
`request_path_loads` (fetches from the artifact store on a request's path: must be 0; copies
from the host tier into one of the 16 device slots made for a request are the device tier's own
work and are counted apart, `slot_copies_for_requests`), `peak_host_revisions` (<= the host
bound), host evictions per second and worker RSS. Prints them and writes bench/results/tiers.json.

    .venv/bin/python bench/tiers.py      # the full run: ~8 min registering, ~6 min serving
    .venv/bin/python bench/tiers.py --adapters 200 --warmup-s 10 --measure-s 20 --baseline-s 10
"""

import argparse
import dataclasses
import json
import logging
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from datetime import UTC, datetime
from multiprocessing import get_context
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
# Two workers, MLflow, the gateway and the clients share a few cores: idle OpenMP threads must
# wait passively, not spin (inherited by the workers).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import httpx
import numpy as np
import psutil

from bench import harness
from bench.harness import percentile
from mint_core.config import LOOPBACK, MintConfig
from mint_core.revisions import PRODUCTION
from processes import ManagedProcess, free_port

PROMPT = "tiers="
NEW_TOKENS = 4
RANK = 2
TARGET_MODULES = ("q_proj", "v_proj")
STD = 0.3
"""Spread of the LoRA weights: large enough that each adapter changes the base's answers."""
ACTOR = "bench"
GIVE_UP_S = 60.0
"""How long a client still waits for a cold adapter's 200 once the window has ended."""
SCRAPE_S = 1.0


# --- Registration ------------------------------------------------------------------------------


def adapter_name(number: int) -> str:
    return f"tier-{number:05d}"


_MAKER: dict[str, Any] = {}
"""Per registration process: the configuration, the loaded base, the store, the template."""


def _start_maker(config: MintConfig, template: Path) -> None:
    import torch

    from mint_core.artifacts.stores import open_store
    from mint_core.model.base import load_base

    torch.set_num_threads(1)
    logging.disable(logging.WARNING)
    from safetensors import safe_open

    with safe_open(template / "adapter_model.safetensors", framework="pt") as weights:
        shapes = {key: tuple(weights.get_slice(key).get_shape()) for key in weights.keys()}  # noqa: SIM118
    _MAKER.update(
        config=config,
        base=load_base(config.base, config.home),
        store=open_store(config),
        adapter_config=(template / "adapter_config.json").read_text(),
        shapes=shapes,
    )


def make_artifact(number: int) -> tuple[Any, str]:
    """Adapter `number`'s LoRA (tensors from its own seed) written as a PEFT folder, checked as
    an import, frozen, packed and exported: its policy record (as `register_revision` writes
    it) and its artifact URI."""
    import shutil

    import torch
    from safetensors.torch import save_file

    from mint_core.artifacts.freezing import PEFT_CONFIG, PEFT_WEIGHTS, freeze
    from mint_core.artifacts.packing import pack
    from mint_core.model.imports import inspect_import
    from mint_core.revisions import PolicyRecord

    config: MintConfig = _MAKER["config"]
    name = adapter_name(number)
    folder = config.work_root / "peft" / name
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(1_000_003 * (number + 1))
    tensors = {
        key: torch.randn(shape, generator=generator) * STD
        for key, shape in _MAKER["shapes"].items()
    }
    save_file(tensors, folder / PEFT_WEIGHTS, metadata={"format": "pt"})
    (folder / PEFT_CONFIG).write_text(_MAKER["adapter_config"])
    imported = inspect_import(folder, _MAKER["base"])
    frozen = freeze(folder, config.frozen_root)
    packed_dir = config.work_root / "packed" / frozen.digest.removeprefix("sha256:")
    index = pack(frozen, packed_dir)
    uri = _MAKER["store"].put(packed_dir, index.content_digest)
    shutil.rmtree(folder)
    shutil.rmtree(packed_dir)
    policy = PolicyRecord(
        adapter=name,
        content_digest=index.content_digest,
        created_by=ACTOR,
        created_at=datetime.now(UTC).isoformat(),
        frozen_digest=frozen.digest,
        **imported.policy_fields(),  # type: ignore[arg-type]
    )
    return policy, uri


def write_template(config: MintConfig, folder: Path) -> None:
    """One PEFT LoRA of the benchmark's shape over the base: its config and tensor shapes are
    every adapter's."""
    from peft import LoraConfig, get_peft_model

    from mint_core.model.base import load_base

    base = load_base(config.base, config.home)
    lora = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=list(TARGET_MODULES))
    get_peft_model(base.model, lora).save_pretrained(folder)


class RegistryWriter:
    """Writes each adapter into MLflow's database with MLflow's client, as a release leaves it:
    the registered model, version 1 with the policy record's tags at stage `active`, and
    `production` on it through `registry.aliases.point` (the pipeline's alias intent with it)."""

    def __init__(self, database_uri: str) -> None:
        from mlflow.tracking import MlflowClient

        from mint_core.registry import Registry

        logging.getLogger("mlflow").setLevel(logging.WARNING)
        self.client = MlflowClient(tracking_uri=database_uri, registry_uri=database_uri)
        self.registry = Registry(database_uri)

    def write(self, policy: Any, uri: str) -> None:
        from mint_core.registry import KIND_TAG, STAGE_TAG
        from mint_core.registry._mlflow import ACTIVATED_AT_TAG, ADAPTER_KIND, BASE_DIGEST_TAG
        from mint_core.revisions import RevisionId
        from mint_core.states import Stage

        self.client.create_registered_model(
            policy.adapter,
            tags={KIND_TAG: ADAPTER_KIND, BASE_DIGEST_TAG: policy.base_digest},
            description=f"MinT adapter over base {policy.base_model_id}",
        )
        tags = {
            **policy.to_tags(),
            STAGE_TAG: Stage.ACTIVE.value,
            ACTIVATED_AT_TAG: policy.created_at,
        }
        version = self.client.create_model_version(
            policy.adapter, source=uri, tags=tags, await_creation_for=0
        )
        revision = RevisionId(policy.adapter, int(version.version))
        self.registry.aliases.point(revision, PRODUCTION, actor=ACTOR)


def register_all(
    config: MintConfig, database_uri: str, adapters: int, jobs: int
) -> dict[str, float]:
    """Every adapter's artifact made by `jobs` processes and written into MLflow by this one,
    overlapping; seconds and rates."""
    template = config.work_root / "template"
    write_template(config, template)
    writer = RegistryWriter(database_uri)
    start = time.perf_counter()
    artifacts_s = mlflow_s = 0.0
    with ProcessPoolExecutor(
        jobs, mp_context=get_context("spawn"), initializer=_start_maker,
        initargs=(config, template),
    ) as makers:  # fmt: skip
        waited = time.perf_counter()
        for done, (policy, uri) in enumerate(
            makers.map(make_artifact, range(adapters), chunksize=8), start=1
        ):
            written = time.perf_counter()
            artifacts_s += written - waited
            writer.write(policy, uri)
            waited = time.perf_counter()
            mlflow_s += waited - written
            if done % 500 == 0 or done == adapters:
                elapsed = time.perf_counter() - start
                print(f"  registered {done:,}/{adapters:,} in {elapsed:.0f} s "
                      f"({done / elapsed:.1f}/s)", flush=True)  # fmt: skip
    total_s = time.perf_counter() - start
    return {
        "register_s": total_s,
        "register_per_s": adapters / total_s,
        "mlflow_write_s": mlflow_s,
        "waiting_for_artifacts_s": artifacts_s,
    }


# --- Worker-side figures -------------------------------------------------------------------------


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}, the sample lines as written."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values


def host_resident(metrics: dict[str, float]) -> float:
    return metrics.get('mint_tier_resident{tier="host"}', 0.0)


def device_resident(metrics: dict[str, float]) -> float:
    return metrics.get('mint_tier_resident{tier="device"}', 0.0)


def host_evictions(metrics: dict[str, float]) -> float:
    return metrics.get('mint_tier_evictions_total{tier="host"}', 0.0)


def host_loads(metrics: dict[str, float]) -> float:
    return metrics.get('mint_tier_loads_total{tier="host"}', 0.0)


def device_loads(metrics: dict[str, float]) -> float:
    return metrics.get('mint_tier_loads_total{tier="device"}', 0.0)


def request_path_loads(health: dict[str, Any]) -> int:
    """Loads a request waited for from outside the worker's memory: fetches from the artifact
    store on a request's path (the readiness gate keeps them at zero)."""
    return int(health["request_path_fetches"])


def slot_copies_for_requests(health: dict[str, Any]) -> int:
    """Copies from the host tier into a device slot made for a user's request: the device
    tier's own work when more adapters are in use than there are slots (16 here)."""
    return int(health["request_path_loads"]) - request_path_loads(health)


def ready_revisions(routing: dict[str, Any]) -> list[str]:
    return list(routing.get("ready", []))


def rss_bytes(process: ManagedProcess) -> int:
    """The worker's resident memory, its children's included."""
    try:
        root = psutil.Process(process.process.pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
    except psutil.NoSuchProcess:
        return 0


class Scraper:
    """Every `SCRAPE_S`, each worker's `/metrics` and RSS, stamped by the monotonic clock."""

    def __init__(self, workers: list[ManagedProcess]) -> None:
        self.workers = workers
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=10) as http:
            while not self._stop.is_set():
                at = time.monotonic()
                sample: dict[str, Any] = {"at": at, "workers": []}
                for worker in self.workers:
                    try:
                        metrics = parse_metrics(http.get(worker.url + "/metrics").text)
                    except httpx.HTTPError:
                        metrics = {}
                    sample["workers"].append({
                        "host": host_resident(metrics),
                        "device": device_resident(metrics),
                        "host_evictions": host_evictions(metrics),
                        "host_loads": host_loads(metrics),
                        "device_loads": device_loads(metrics),
                        "rss": rss_bytes(worker),
                    })  # fmt: skip
                self.samples.append(sample)
                self._stop.wait(max(0.0, SCRAPE_S - (time.monotonic() - at)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, start: float, end: float) -> list[dict[str, Any]]:
        return [s for s in self.samples if start <= s["at"] <= end]


# --- Clients -------------------------------------------------------------------------------------


def zipf_weights(count: int, s: float = 1.0) -> np.ndarray:
    """Cumulative Zipf(s) probabilities over ranks 1..count."""
    weights = 1.0 / np.arange(1, count + 1) ** s
    return np.cumsum(weights / weights.sum())


def retry_wait_s(response: httpx.Response) -> float:
    """The wait a 503 asks for: `Retry-After-Ms` (milliseconds) if present, else
    `Retry-After` (seconds), else one second."""
    if (ms := response.headers.get("Retry-After-Ms")) is not None:
        return float(ms) / 1000
    if (seconds := response.headers.get("Retry-After")) is not None:
        return float(seconds)
    return 1.0


def not_ready(response: httpx.Response) -> bool:
    if response.status_code != 503:
        return False
    try:
        return response.json().get("error_type") == "not_ready"
    except ValueError:
        return False


@dataclasses.dataclass
class Traffic:
    """What the clients saw: one entry per request (an adapter asked until its 200)."""

    warm: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    """(first send, latency) of each request answered 200 at its first try."""
    cold: list[tuple[float, float, int]] = dataclasses.field(default_factory=list)
    """(first send, seconds from the first 503 to the 200, 503s) of each request that had to
    wait."""
    gave_up: list[tuple[float, str]] = dataclasses.field(default_factory=list)
    """(first send, adapter) of waits given up when the run ended."""
    errors: list[tuple[float, str]] = dataclasses.field(default_factory=list)
    """(send, what) of answers other than 200 and 503 not_ready."""

    def warm_in(self, start: float, end: float) -> list[float]:
        return [latency for at, latency in self.warm if start <= at < end]

    def cold_in(self, start: float, end: float) -> list[float]:
        return [waited for at, waited, _ in self.cold if start <= at < end]


def closed_loop(
    url: str, names: list[str], clients: int, seconds: float, seed: int
) -> tuple[Traffic, float]:
    """`clients` closed-loop clients asking Zipf(1.0)-drawn adapters of `names` (most popular
    first) for `seconds`; what they saw, and the monotonic time they started."""
    traffic = Traffic()
    lock = threading.Lock()
    cumulative = zipf_weights(len(names))
    start = time.monotonic()
    deadline = start + seconds

    def client(number: int) -> None:
        rng = np.random.default_rng([seed, number])
        with httpx.Client(base_url=url, timeout=120) as http:
            while time.monotonic() < deadline:
                rank = min(int(np.searchsorted(cumulative, rng.random())), len(names) - 1)
                name = names[rank]
                body = {"inputs": PROMPT, "parameters": {
                    "adapter_id": f"{name}@{PRODUCTION}", "max_new_tokens": NEW_TOKENS,
                    "do_sample": False}}  # fmt: skip
                sent = time.monotonic()
                first_503: float | None = None
                refusals = 0
                while True:
                    try:
                        response = http.post("/generate", json=body)
                    except httpx.HTTPError as e:
                        with lock:
                            traffic.errors.append((sent, f"{name}: {type(e).__name__} {e}"))
                        break
                    now = time.monotonic()
                    if response.status_code == 200:
                        with lock:
                            if first_503 is None:
                                traffic.warm.append((sent, now - sent))
                            else:
                                traffic.cold.append((sent, now - first_503, refusals))
                        break
                    if not not_ready(response):
                        with lock:
                            traffic.errors.append(
                                (sent, f"{name}: {response.status_code} {response.text[:200]}")
                            )
                        time.sleep(0.1)
                        break
                    refusals += 1
                    first_503 = now if first_503 is None else first_503
                    if now > deadline + GIVE_UP_S:
                        with lock:
                            traffic.gave_up.append((sent, name))
                        break
                    time.sleep(retry_wait_s(response))

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    return traffic, start


# --- The run -------------------------------------------------------------------------------------


def start_fleet(
    config: MintConfig, services: list[ManagedProcess], readers: dict[str, str]
) -> tuple[MintConfig, list[ManagedProcess], ManagedProcess]:
    """Two workers that know each other's URLs, and a gateway over them, each reading the
    registry with `readers` (the worker's account)."""
    from serving.gateway import start_gateway
    from serving.worker.server import start_worker

    ports = [free_port(), free_port()]
    urls = tuple(f"http://{LOOPBACK}:{port}" for port in ports)
    fleet = dataclasses.replace(config, worker_urls=urls, replicas=1)
    with ThreadPoolExecutor(len(ports)) as pool:
        started = [
            pool.submit(
                start_worker, dataclasses.replace(fleet, worker_url=url), port, 600.0, readers
            )
            for port, url in zip(ports, urls, strict=True)
        ]
        workers = []
        for future in started:
            workers.append(future.result())
            services.append(workers[-1])
    gateway = start_gateway(fleet, timeout_s=600.0, env=readers)
    services.append(gateway)
    return fleet, workers, gateway


def main() -> None:
    parser = harness.command_line(__doc__, "tiers")
    parser.add_argument("--adapters", type=int, default=10_000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--warmup-s", type=float, default=60.0)
    parser.add_argument("--measure-s", type=float, default=180.0)
    parser.add_argument("--baseline-s", type=float, default=60.0)
    parser.add_argument("--host-adapters", type=int, default=100)
    parser.add_argument("--device-slots", type=int, default=16)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="processes making the artifacts")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    harness.add_home(parser)
    parser.add_argument("--register-only", action="store_true",
                        help="stop after registration and the snapshot (to time them)")  # fmt: skip
    args = parser.parse_args()

    base = harness.default_base(args.home)
    with harness.scratch("tiers") as (work, services):
        (work / "base").symlink_to(base.parent, target_is_directory=True)
        mlflow = harness.start_registry(work / "registry", services)
        config = MintConfig(
            home=work,
            tracking_uri=mlflow.url,
            host_adapters=args.host_adapters,
            device_slots=args.device_slots,
        )
        run(args, config, work, mlflow, services)


def run(
    args: argparse.Namespace,
    config: MintConfig,
    work: Path,
    mlflow: ManagedProcess,
    services: list[ManagedProcess],
) -> None:
    from mint_core.artifacts.stores import open_store
    from mint_core.catalog.catalog import build_snapshot
    from mint_core.registry import Registry

    database_uri = f"sqlite:///{work / 'registry' / 'mlflow.db'}"
    print(f"registering {args.adapters:,} adapters ({args.jobs} processes making artifacts)",
          flush=True)  # fmt: skip
    registered = register_all(config, database_uri, args.adapters, args.jobs)
    start = time.perf_counter()
    snapshot = build_snapshot(Registry(database_uri), open_store(config), work / "snapshot")
    registered["snapshot_s"] = time.perf_counter() - start
    print(f"registered {args.adapters:,} in {registered['register_s']:.0f} s "
          f"({registered['register_per_s']:.1f}/s; MLflow writes {registered['mlflow_write_s']:.0f}"
          f" s of it); snapshot {snapshot.name} in {registered['snapshot_s']:.1f} s",
          flush=True)  # fmt: skip
    if args.register_only:
        harness.write(args.out, {"adapters": args.adapters, "jobs": args.jobs, **registered,
                                 "machine": harness.machine()})  # fmt: skip
        return

    start = time.perf_counter()
    fleet, workers, gateway = start_fleet(config, services, harness.worker_env(mlflow))
    fleet_start_s = time.perf_counter() - start
    print(f"two workers and the gateway up in {fleet_start_s:.0f} s", flush=True)

    rng = np.random.default_rng(args.seed)
    by_rank = [adapter_name(int(n)) for n in rng.permutation(args.adapters)]
    scraper = Scraper(workers)
    total_s = args.warmup_s + args.measure_s
    print(f"main run: {args.clients} clients, {args.warmup_s:.0f} s warm-up + "
          f"{args.measure_s:.0f} s measured", flush=True)  # fmt: skip
    traffic, started = closed_loop(gateway.url, by_rank, args.clients, total_s, args.seed)
    window = (started + args.warmup_s, started + total_s)

    with httpx.Client(timeout=30) as http:
        ready = sorted(
            {r for w in workers for r in ready_revisions(http.get(w.url + "/admin/routing").json())}
        )
    ready_names = {r.partition(":")[0] for r in ready}
    baseline_names = [name for name in by_rank if name in ready_names]  # popularity kept
    print(f"baseline: {len(baseline_names)} ready adapters, {args.baseline_s:.0f} s", flush=True)
    baseline = Traffic()
    baseline_window = (0.0, 0.0)
    if baseline_names:
        baseline, baseline_start = closed_loop(
            gateway.url, baseline_names, args.clients, args.baseline_s, args.seed + 1
        )
        baseline_window = (baseline_start, baseline_start + args.baseline_s)
    scraper.stop()

    with httpx.Client(timeout=30) as http:
        health = [http.get(w.url + "/health").json() for w in workers]
    result = summarize(args, traffic, window, baseline, baseline_window, scraper, health)
    result |= {
        "registration": registered,
        "fleet_start_s": fleet_start_s,
        "baseline_adapters": len(baseline_names),
        "snapshot": snapshot.name,
        "settings": {
            "adapters": args.adapters,
            "clients": args.clients,
            "warmup_s": args.warmup_s,
            "measure_s": args.measure_s,
            "baseline_s": args.baseline_s,
            "host_adapters": fleet.host_adapters,
            "device_slots": fleet.device_slots,
            "workers": len(workers),
            "rank": RANK,
            "target_modules": list(TARGET_MODULES),
            "new_tokens": NEW_TOKENS,
            "zipf_s": 1.0,
            "seed": args.seed,
        },
        "machine": harness.machine(),
    }
    report(result)
    harness.write(args.out, result)


def quantiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "p99": None, "max": None}
    return {
        "p50": statistics.median(values),
        "p95": percentile(values, 0.95),
        "p99": percentile(values, 0.99),
        "max": max(values),
    }


def summarize(
    args: argparse.Namespace,
    traffic: Traffic,
    window: tuple[float, float],
    baseline: Traffic,
    baseline_window: tuple[float, float],
    scraper: Scraper,
    health: list[dict[str, Any]],
) -> dict[str, Any]:
    warm = traffic.warm_in(*window)
    cold = traffic.cold_in(*window)
    refused = sum(n for at, _, n in traffic.cold if window[0] <= at < window[1])
    gave_up = [name for at, name in traffic.gave_up if window[0] <= at < window[1]]
    errors = [what for at, what in traffic.errors if window[0] <= at < window[1]]
    requests = len(warm) + len(cold) + len(gave_up)
    base_warm = baseline.warm_in(*baseline_window)
    base_refused = len(baseline.cold_in(*baseline_window))
    warm_q, cold_q, base_q = quantiles(warm), quantiles(cold), quantiles(base_warm)

    samples = scraper.between(*window)
    per_worker = []
    for n in range(len(scraper.workers)):
        of = [s["workers"][n] for s in samples]
        every = [s["workers"][n] for s in scraper.samples]

        def grew(key: str, of: list[dict[str, float]] = of) -> float:
            return of[-1][key] - of[0][key] if len(of) > 1 else 0.0

        per_worker.append({
            "peak_host_revisions": max((w["host"] for w in every), default=0.0),
            "peak_host_revisions_measured": max((w["host"] for w in of), default=0.0),
            "peak_device_revisions": max((w["device"] for w in every), default=0.0),
            "host_evictions_measured": grew("host_evictions"),
            "host_loads_measured": grew("host_loads"),
            "device_loads_measured": grew("device_loads"),
            "rss_peak_mb": max((w["rss"] for w in every), default=0) / 2**20,
            "rss_end_mb": (every[-1]["rss"] / 2**20) if every else 0.0,
            "request_path_loads": request_path_loads(health[n]),
            "slot_copies_for_requests": slot_copies_for_requests(health[n]),
        })  # fmt: skip
    buckets = []
    started = window[0] - args.warmup_s
    for first in np.arange(started, window[1], 10.0):
        hits = sum(1 for at, _ in traffic.warm if first <= at < first + 10)
        waits = sum(1 for at, _, _ in traffic.cold if first <= at < first + 10)
        buckets.append(round(hits / (hits + waits), 4) if hits + waits else None)
    measured_s = (samples[-1]["at"] - samples[0]["at"]) if len(samples) > 1 else args.measure_s
    return {
        "requests": requests,
        "hit_ratio": len(warm) / requests if requests else None,
        "warm_requests": len(warm),
        "cold_requests": len(cold),
        "not_ready_answers": refused,
        "gave_up": len(gave_up),
        "errors": len(errors),
        "error_samples": errors[:5],
        "requests_per_s": requests / args.measure_s,
        "hit_ratio_every_10s": buckets,
        "cold_p50_s": cold_q["p50"],
        "cold_p99_s": cold_q["p99"],
        "cold_max_s": cold_q["max"],
        "warm_p50_s": warm_q["p50"],
        "warm_p95_s": warm_q["p95"],
        "baseline_requests": len(base_warm),
        "baseline_not_ready": base_refused,
        "baseline_p50_s": base_q["p50"],
        "baseline_p95_s": base_q["p95"],
        "warm_p95_ratio": (
            warm_q["p95"] / base_q["p95"] if warm_q["p95"] and base_q["p95"] else None
        ),
        "request_path_loads": sum(w["request_path_loads"] for w in per_worker),
        "slot_copies_for_requests": sum(w["slot_copies_for_requests"] for w in per_worker),
        "peak_host_revisions": max(w["peak_host_revisions"] for w in per_worker),
        "host_bound": args.host_adapters,
        "host_evictions_per_s": sum(w["host_evictions_measured"] for w in per_worker) / measured_s,
        "worker_rss_peak_mb": max(w["rss_peak_mb"] for w in per_worker),
        "workers": per_worker,
        "samples": {
            "warm_s": warm,
            "cold_s": cold,
            "baseline_warm_s": base_warm,
            "scrapes": [
                {"t": round(s["at"] - window[0], 2), "workers": s["workers"]}
                for s in scraper.samples
            ],
        },
    }


def report(result: dict[str, Any]) -> None:
    def show(value: object) -> str:
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    keys = [
        "requests", "hit_ratio", "cold_requests", "not_ready_answers", "gave_up", "errors",
        "cold_p50_s", "cold_p99_s", "warm_p50_s", "warm_p95_s", "baseline_requests",
        "baseline_not_ready", "baseline_p95_s", "warm_p95_ratio", "request_path_loads",
        "peak_host_revisions", "host_bound", "host_evictions_per_s", "worker_rss_peak_mb",
    ]  # fmt: skip
    for key in keys:
        print(f"  {key:<22} {show(result[key])}")
    for n, worker in enumerate(result["workers"]):
        print(f"  worker {n}: " + ", ".join(f"{k} {show(v)}" for k, v in worker.items()))
    if result["error_samples"]:
        print("errors:", *result["error_samples"], sep="\n  ")
    print(json.dumps({"aims": {
        "cold_p50_s <= 1": result["cold_p50_s"] is not None and result["cold_p50_s"] <= 1,
        "cold_p99_s <= 3": result["cold_p99_s"] is not None and result["cold_p99_s"] <= 3,
        "warm_p95_ratio <= 1.10": (result["warm_p95_ratio"] or 99) <= 1.10,
        "request_path_loads == 0": result["request_path_loads"] == 0,
        "peak_host_revisions <= bound": result["peak_host_revisions"] <= result["host_bound"],
    }}))  # fmt: skip


if __name__ == "__main__":
    main()
