"""Backends benchmark: the same closed-loop load against MinT's embedded worker, a MinT worker in
front of vLLM, and vLLM alone (no MinT in front), in one run.

16 random rank-8 LoRAs are registered in a real `mlflow server` and activated on two workers
(one per backend); a third process is a bare vLLM server, started the way the vLLM worker starts
its own, with the same 16 adapters loaded by `/v1/load_lora_adapter`. Then 16 closed-loop
clients (client i always asks for adapter i, greedy, the same prompt tokens) run against each
target in turn, for several rounds (targets interleaved, so a noisy machine hits all three
alike). Every request generates the same tokens on every target (greedy, the same weights: checked
before any clock starts), so tokens/s compare like for like; vLLM alone gets exactly the
request the vLLM worker sends it. Reports generated tokens/s and p50/p95 request latency per
target (medians over rounds), and the gateway's cost: MinT-in-front-of-vLLM's p50 over vLLM
alone's, minus one. Writes bench/results/backends.json.

    .venv/bin/python bench/backends.py                      # 16 adapters, 16 clients
    .venv/bin/python bench/backends.py --rounds 1 --window 3  # a smoke run
"""

import dataclasses
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
# Named, not made: Prefect makes it when it first writes (a mkdtemp here was a folder left
# behind by every run, used or not).
os.environ.setdefault(
    "PREFECT_HOME", os.path.join(tempfile.gettempdir(), f"mint-bench-prefect-{os.getpid()}")
)
# Three engines share this CPU and take turns: OpenMP threads of the idle ones must wait
# passively, not spin (inherited by the workers and the vLLM servers).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import httpx
import psutil

from bench import harness
from mint_core.config import BackendKind, MintConfig
from mint_core.model.base import load_base, load_text
from mint_core.registry import Registry
from mint_core.revisions import PRODUCTION, RevisionId
from processes import ManagedProcess
from serving.backends.vllm import VllmServer, VllmSettings
from serving.worker.server import start_worker
from tasks.pipeline import wait_fleet_ready
from tests.integration.helpers import register_random_adapter

PROMPT = "benchmark the backends="
MINT_EXTRA: dict[str, object] = {"return_token_ids": True}
START_TIMEOUT_S = 900


@dataclasses.dataclass
class Target:
    """Something that answers completions: a MinT worker, or vLLM alone."""

    name: str
    url: str
    headers: dict[str, str]
    models: list[str]
    """What client i puts in `model`."""
    prompt: str | list[int]
    """Text for a MinT worker; the same text's token ids for bare vLLM."""
    extra: dict[str, object] = dataclasses.field(default_factory=dict)
    process: ManagedProcess | None = None
    """The MinT worker's process, whose own CPU time (its vLLM child's not included) is the
    gateway's cost; None for vLLM alone."""


def closed_loop(target: Target, new_tokens: int, window_s: float) -> dict[str, float]:
    """One client per model, each sending its next request as soon as the last is answered,
    for `window_s`: generated tokens/s and request latency percentiles (ms)."""
    latencies: list[float] = []
    tokens = 0
    errors: list[str] = []
    lock = threading.Lock()
    deadline = time.monotonic() + window_s

    def client(model: str) -> None:
        nonlocal tokens
        body = {"model": model, "prompt": target.prompt, "max_tokens": new_tokens,
                "temperature": 0, **target.extra}  # fmt: skip
        with httpx.Client(base_url=target.url, headers=target.headers, timeout=120) as http:
            while time.monotonic() < deadline:
                started = time.monotonic()
                response = http.post("/v1/completions", json=body)
                latency = time.monotonic() - started
                if response.status_code != 200:
                    with lock:
                        errors.append(f"{model}: {response.status_code} {response.text[:200]}")
                    continue
                usage = response.json()["usage"]["completion_tokens"]
                with lock:
                    latencies.append(latency)
                    tokens += usage

    started = time.monotonic()
    with ThreadPoolExecutor(len(target.models)) as pool:
        list(pool.map(client, target.models))
    elapsed = time.monotonic() - started
    if errors:
        raise RuntimeError(f"{target.name}: {len(errors)} errors, first: {errors[0]}")
    return {
        "tok_s": tokens / elapsed,
        "requests": len(latencies),
        "p50_ms": 1000 * statistics.median(latencies),
        "p95_ms": 1000 * harness.percentile(latencies, 0.95),
    }


def same_work(target: Target, new_tokens: int) -> list[list[int]]:
    """Each model's answer on `target` (token ids): every target must generate the same."""
    answers = []
    with httpx.Client(base_url=target.url, headers=target.headers, timeout=120) as http:
        for model in target.models:
            body = {"model": model, "prompt": target.prompt, "max_tokens": new_tokens,
                    "temperature": 0, **target.extra}  # fmt: skip
            response = http.post("/v1/completions", json=body)
            response.raise_for_status()
            answers.append(response.json()["choices"][0]["token_ids"])
    return answers


def production_adapters(
    config: MintConfig, count: int, services: list[ManagedProcess]
) -> tuple[MintConfig, list[RevisionId], dict[str, Path], dict[str, str]]:
    """A real `mlflow server` with its authentication (in `services`) holding `count` random
    rank-8 LoRAs of the base, registered as bench-N@production: the configuration that follows
    it, the revisions, each revision's PEFT folder, and the environment a worker reads it
    with."""
    mlflow = harness.start_registry(config.home / "registry", services)
    config = dataclasses.replace(config, tracking_uri=mlflow.url)
    base = load_base(config.base, config.home)
    registry = Registry(config.tracking_uri)
    revisions: list[RevisionId] = []
    folders: dict[str, Path] = {}
    for n in range(count):
        folder = config.home / "adapters" / f"bench-{n}"
        # Rank 8 for all: seeds 7, 15, ... (rank = 1 + seed % 8).
        revision = register_random_adapter(config, base, f"bench-{n}", folder, 8 * n + 7)
        registry.aliases.point(revision, PRODUCTION)
        revisions.append(revision)
        folders[str(revision)] = folder
    return config, revisions, folders, harness.worker_env(mlflow)


def wait_ready(
    config: MintConfig, workers: list[ManagedProcess], revisions: list[RevisionId]
) -> MintConfig:
    """The fleet of `workers`, once each serves every revision."""
    fleet = dataclasses.replace(config, worker_urls=tuple(w.url for w in workers))
    for revision in revisions:
        wait_fleet_ready(fleet, revision, timeout_s=600)
    return fleet


def bare_vllm(config: MintConfig, folders: dict[str, Path]) -> tuple[ManagedProcess, VllmServer]:
    """vLLM started as the worker starts it, with the adapters loaded: no MinT in front."""
    server = VllmServer(VllmSettings.from_config(config), load_text(config.base, config.home))
    server.sockets = config.home / "vllm-sockets"  # removed with the scratch folder
    process = server.start()
    headers = {"Authorization": f"Bearer {server.api_key}"}
    for name, folder in folders.items():
        body = {"lora_name": name, "lora_path": str(folder.absolute())}
        response = httpx.post(server.url + "/v1/load_lora_adapter", json=body, headers=headers)
        response.raise_for_status()
    return process, server


def main() -> None:
    parser = harness.command_line(__doc__, "backends")
    parser.add_argument("--adapters", type=int, default=16, help="adapters = clients")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--window", type=float, default=10.0, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=5, help="rounds over the three targets")
    args = parser.parse_args()

    with harness.scratch("backends") as (home, services):
        config = MintConfig(
            home=home, max_lora_rank=8, device_slots=args.adapters, max_batch=args.adapters
        )
        config, revisions, folders, readers = production_adapters(config, args.adapters, services)
        kinds = (BackendKind.EMBEDDED, BackendKind.VLLM)
        with ThreadPoolExecutor(len(kinds)) as pool:
            started = {
                kind: pool.submit(
                    start_worker,
                    dataclasses.replace(config, backend=kind),
                    None,
                    START_TIMEOUT_S,
                    readers,
                )
                for kind in kinds
            }
            # From this thread: vLLM gets SIGTERM when the thread that started it ends.
            vllm_process, vllm_server = bare_vllm(config, folders)
            services.append(vllm_process)
            workers = {kind: future.result() for kind, future in started.items()}
            services += workers.values()
        wait_ready(config, list(workers.values()), revisions)

        codec = load_text(config.base, home).codec
        names = [f"{r.adapter}@production" for r in revisions]
        targets = [
            Target(
                "embedded",
                workers[BackendKind.EMBEDDED].url,
                {},
                names,
                PROMPT,
                MINT_EXTRA,
                workers[BackendKind.EMBEDDED],
            ),
            Target(
                "vllm_mint",
                workers[BackendKind.VLLM].url,
                {},
                names,
                PROMPT,
                MINT_EXTRA,
                workers[BackendKind.VLLM],
            ),
            Target(
                "vllm_direct",
                vllm_server.url,
                {"Authorization": f"Bearer {vllm_server.api_key}"},
                [str(r) for r in revisions],
                codec.encode(PROMPT),
                # What the vLLM worker itself asks vLLM for (VllmBackend._payload): the gateway's
                # cost is all that differs.
                MINT_EXTRA
                | {
                    "stop_token_ids": sorted(codec.eos_ids),
                    "skip_special_tokens": False,
                    "logprobs": 0,
                },
            ),
        ]
        answers = {target.name: same_work(target, args.new_tokens) for target in targets}
        if len({tuple(map(tuple, a)) for a in answers.values()}) != 1:
            raise RuntimeError(f"the targets generate different tokens: {answers}")
        for target in targets:  # warm every path once before any clock
            closed_loop(target, args.new_tokens, 1.0)
        rounds: dict[str, list[dict[str, float]]] = {t.name: [] for t in targets}
        for number in range(args.rounds):
            for target in targets:
                cpu = psutil.Process(target.process.process.pid) if target.process else None
                cpu_before = sum(cpu.cpu_times()[:2]) if cpu else 0.0
                result = closed_loop(target, args.new_tokens, args.window)
                if cpu is not None:
                    # The worker's own CPU time (not its vLLM child's) per request answered.
                    spent = sum(cpu.cpu_times()[:2]) - cpu_before
                    result["worker_cpu_ms_per_request"] = 1000 * spent / result["requests"]
                rounds[target.name].append(result)
                print(
                    f"round {number + 1} {target.name:12s} {result['tok_s']:8.1f} tok/s  "
                    f"p50 {result['p50_ms']:7.1f} ms  p95 {result['p95_ms']:7.1f} ms  "
                    f"({result['requests']} requests)"
                )

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in rounds[name])

    overheads = [
        mint["p50_ms"] / direct["p50_ms"] - 1
        for mint, direct in zip(rounds["vllm_mint"], rounds["vllm_direct"], strict=True)
    ]
    summary = {
        "adapters": args.adapters,
        "clients": args.adapters,
        "new_tokens": args.new_tokens,
        "window_s": args.window,
        "rounds": rounds,
        "embedded_tok_s": median("embedded", "tok_s"),
        "vllm_mint_tok_s": median("vllm_mint", "tok_s"),
        "vllm_direct_tok_s": median("vllm_direct", "tok_s"),
        "embedded_p50_ms": median("embedded", "p50_ms"),
        "vllm_mint_p50_ms": median("vllm_mint", "p50_ms"),
        "vllm_direct_p50_ms": median("vllm_direct", "p50_ms"),
        "embedded_p95_ms": median("embedded", "p95_ms"),
        "vllm_mint_p95_ms": median("vllm_mint", "p95_ms"),
        "vllm_direct_p95_ms": median("vllm_direct", "p95_ms"),
        "gateway_p50_overhead": statistics.median(overheads),
        "gateway_cpu_ms_per_request": median("vllm_mint", "worker_cpu_ms_per_request"),
        "gateway_p50_overheads": overheads,
        "cpu_count": os.cpu_count(),
    }
    print(
        f"\nmedians over {args.rounds} rounds: embedded {summary['embedded_tok_s']:.1f} tok/s, "
        f"vLLM behind MinT {summary['vllm_mint_tok_s']:.1f} tok/s, vLLM alone "
        f"{summary['vllm_direct_tok_s']:.1f} tok/s; gateway p50 overhead "
        f"{100 * summary['gateway_p50_overhead']:+.1f}%; the gateway (the vLLM worker's own "
        f"process) spent {summary['gateway_cpu_ms_per_request']:.1f} ms of CPU per request"
    )
    harness.write(args.out, summary)


if __name__ == "__main__":
    main()
