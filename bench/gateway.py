"""Gateway benchmark: `mint gateway` in front of two workers against one worker called directly,
under the same closed-loop load, in one run.

8 random rank-8 LoRAs are registered in a real `mlflow server` and activated on two embedded
workers of the same base; a gateway process fronts both. Two loads, each run against the
gateway and against the first worker directly, targets interleaved over several rounds:

- **latency**: one client, 4 new tokens a request: the gateway's added p50 is its own hop
  (parse, route, forward, pass the answer back), the one worker and the gateway's chosen one
  being equally idle;
- **throughput**: 8 clients (client i asks for adapter i), 32 new tokens: generated tokens/s
  through the gateway (two workers) over one worker directly. On this 2-core machine both
  workers share the same cores, so the ratio says what the gateway costs more than what a
  second machine would add.

Every answer through the gateway is checked to equal the direct one before any clock starts.
Reports medians over rounds; writes bench/results/gateway.json.

    .venv/bin/python bench/gateway.py                       # 5 rounds of 5 s per load
    .venv/bin/python bench/gateway.py --rounds 1 --window 2  # a smoke run
"""

import dataclasses
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil

from bench import harness
from bench.backends import (
    MINT_EXTRA,
    Target,
    closed_loop,
    production_adapters,
    same_work,
    wait_ready,
)
from mint_core.config import MintConfig
from serving.gateway import start_gateway
from serving.worker.server import start_worker

PROMPT = "benchmark the gateway="
LOADS = {"latency": (1, 4), "throughput": (8, 32)}
"""Load name -> (clients, new tokens per request)."""


def main() -> None:
    parser = harness.command_line(__doc__, "gateway")
    parser.add_argument("--window", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    adapters = max(clients for clients, _ in LOADS.values())

    with harness.scratch("gateway") as (home, services):
        config = MintConfig(home=home, device_slots=adapters)
        config, revisions, _, readers = production_adapters(config, adapters, services)
        workers = [start_worker(config, env=readers), start_worker(config, env=readers)]
        services += workers
        fleet = wait_ready(config, workers, revisions)
        gateway = start_gateway(fleet, env=readers)
        services.append(gateway)

        names = [f"{r.adapter}@production" for r in revisions]
        targets = {
            "direct": Target("direct", workers[0].url, {}, names, PROMPT, MINT_EXTRA, workers[0]),
            "gateway": Target("gateway", gateway.url, {}, names, PROMPT, MINT_EXTRA, gateway),
        }
        longest = max(tokens for _, tokens in LOADS.values())
        answers = {name: same_work(t, longest) for name, t in targets.items()}
        if answers["direct"] != answers["gateway"]:
            raise RuntimeError("the gateway's answers differ from the worker's")
        rounds: dict[str, list[dict[str, float]]] = {
            f"{load}_{name}": [] for load in LOADS for name in targets
        }
        for clients, tokens in LOADS.values():  # warm every path once
            for target in targets.values():
                closed_loop(dataclasses.replace(target, models=names[:clients]), tokens, 1.0)
        gateway_cpu = psutil.Process(gateway.process.pid)
        for number in range(args.rounds):
            for load, (clients, tokens) in LOADS.items():
                for name, target in targets.items():
                    cpu_before = sum(gateway_cpu.cpu_times()[:2])
                    loaded = dataclasses.replace(target, models=names[:clients])
                    result = closed_loop(loaded, tokens, args.window)
                    if name == "gateway":
                        spent = sum(gateway_cpu.cpu_times()[:2]) - cpu_before
                        result["gateway_cpu_ms_per_request"] = 1000 * spent / result["requests"]
                    rounds[f"{load}_{name}"].append(result)
                    print(
                        f"round {number + 1} {load:10s} {name:8s} {result['tok_s']:8.1f} tok/s  "
                        f"p50 {result['p50_ms']:7.2f} ms  p95 {result['p95_ms']:7.2f} ms  "
                        f"({result['requests']} requests)"
                    )

    def paired(load: str, key: str) -> list[tuple[float, float]]:
        return [
            (g[key], d[key])
            for g, d in zip(rounds[f"{load}_gateway"], rounds[f"{load}_direct"], strict=True)
        ]

    added_ms = [g - d for g, d in paired("latency", "p50_ms")]
    throughput = [g / d for g, d in paired("throughput", "tok_s")]
    summary = {
        "window_s": args.window,
        "rounds": rounds,
        "loads": {load: {"clients": c, "new_tokens": t} for load, (c, t) in LOADS.items()},
        "added_p50_ms": statistics.median(added_ms),
        "added_p50_ms_per_round": added_ms,
        "direct_p50_ms": statistics.median(d for _, d in paired("latency", "p50_ms")),
        "gateway_p50_ms": statistics.median(g for g, _ in paired("latency", "p50_ms")),
        "throughput_ratio": statistics.median(throughput),
        "throughput_ratio_per_round": throughput,
        "gateway_cpu_ms_per_request": statistics.median(
            r["gateway_cpu_ms_per_request"] for r in rounds["latency_gateway"]
        ),
        "cpu_count": os.cpu_count(),
    }
    print(
        f"\nmedians over {args.rounds} rounds: the gateway adds {summary['added_p50_ms']:.2f} ms "
        f"at p50 (one client: {summary['direct_p50_ms']:.2f} ms direct, "
        f"{summary['gateway_p50_ms']:.2f} ms through it); throughput through it over two "
        f"workers / one worker direct: {summary['throughput_ratio']:.2f}x; it spends "
        f"{summary['gateway_cpu_ms_per_request']:.2f} ms of CPU per request"
    )
    harness.write(args.out, summary)


if __name__ == "__main__":
    main()
