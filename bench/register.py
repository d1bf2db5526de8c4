"""Register benchmark: the register step alone (artifacts already exported) against a real
`mlflow server` on loopback, run as `mint registry` runs it (MLflow's basic-auth app, the
pipeline's account signed in), over many revisions; median, p95, the MLflow requests each
registration makes, and the ratio to the reference system's 1.66 s. Two kinds, interleaved:
an imported adapter (no training run: registering makes one; `register_p50_s`, the headline)
and a trained one (its training run exists, made before the clock starts).

Then what authentication adds to one request: the same read (`registered-models/search`,
one model) sent in turn on one connection each as the worker's account, with no credentials
(the 401 answer) and to an MLflow without authentication (`auth_added_p50_ms`: signed in
minus unguarded, the cost of being authenticated; `auth_over_refused_p50_ms`: signed in
minus the 401). Writes bench/results/register.json.

    .venv/bin/python bench/register.py                  # 60 revisions over 6 adapters
    .venv/bin/python bench/register.py --revisions 5    # a smoke run
"""

import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import requests

from bench import harness
from control.services import start_mlflow
from mint_core.artifacts.digests import sha256_json
from mint_core.registry import DatasetLog, Registry
from mint_core.registry_accounts import RegistryAccounts
from mint_core.revisions import PolicyRecord

REFERENCE_S = 1.66
KINDS = ("imported", "trained")
BASE_DIGEST = sha256_json("bench-base")


def policy(adapter: str, number: int) -> PolicyRecord:
    return PolicyRecord(
        adapter=adapter,
        content_digest=sha256_json([adapter, number]),
        base_model_id="mint-tiny-llama-bench",
        base_digest=BASE_DIGEST,
        training_steps=400,
        dataset_digest=sha256_json(["data", number]),
        lora_rank=8,
        lora_alpha=16,
        target_modules=("q_proj", "v_proj"),
        created_by="bench",
        created_at=datetime.now(UTC).isoformat(),
        dataset="/data/bench.jsonl",
        parent_revision=number - 1 if number > 1 else None,
        eval_metrics={"eval_loss": 0.1, "eval_exact_match": 0.9},
    )


class RequestCount:
    """Every HTTP request this process sends (MLflow's client sends through `requests`),
    counted where requests sends it: what one registration costs in round trips."""

    def __init__(self) -> None:
        self.sent = 0
        send = requests.Session.send

        def counted(session: requests.Session, request: Any, **kwargs: Any) -> Any:
            self.sent += 1
            return send(session, request, **kwargs)

        requests.Session.send = counted  # type: ignore[method-assign]

    def during(self, run: Callable[[], object]) -> tuple[float, int]:
        """Seconds `run` took and the requests it sent."""
        before = self.sent
        seconds = harness.seconds(run)
        return seconds, self.sent - before


def read_figures(times: list[float]) -> dict[str, float]:
    return {
        "p50_ms": statistics.median(times) * 1e3,
        "p99_ms": harness.percentile(times, 0.99) * 1e3,
    }


def summary(times: list[float], sent: list[int]) -> dict[str, Any]:
    return {
        "p50_s": statistics.median(times),
        "p95_s": statistics.quantiles(times, n=20)[-1] if len(times) >= 2 else times[0],
        "requests_median": statistics.median(sent),
        "requests_min": min(sent),
        "requests_max": max(sent),
    }


SEARCH = "/api/2.0/mlflow/registered-models/search"
AUTH_CASES = ("signed in", "refused", "unguarded")


def request_costs(guarded: str, unguarded: str, accounts: RegistryAccounts, rounds: int) -> dict:
    """Seconds of one small registry read in each of AUTH_CASES, taking turns, each case on a
    connection of its own kept open (as a worker's client keeps one)."""
    worker = accounts.worker
    targets = {
        "signed in": (guarded, (worker.username, worker.password), 200),
        "refused": (guarded, None, 401),
        "unguarded": (unguarded, None, 200),
    }
    sessions = {case: requests.Session() for case in AUTH_CASES}
    times: dict[str, list[float]] = {case: [] for case in AUTH_CASES}
    try:
        for n in range(rounds + 1):
            for case in harness.alternating(n, AUTH_CASES):
                url, auth, status = targets[case]
                start = time.perf_counter()
                answer = sessions[case].get(url + SEARCH, params={"max_results": 1}, auth=auth)
                seconds = time.perf_counter() - start
                assert answer.status_code == status, (case, answer.status_code, answer.text)
                if n:  # the first round opens the connections
                    times[case].append(seconds)
    finally:
        for session in sessions.values():
            session.close()
    return times


def main() -> None:
    parser = harness.command_line(__doc__, "register")
    parser.add_argument("--revisions", type=int, default=60, help="revisions of each kind")
    parser.add_argument("--adapters", type=int, default=6, help="adapters they are spread over")
    parser.add_argument("--requests", type=int, default=200, help="reads of each auth case")
    args = parser.parse_args()

    load_at_start = os.getloadavg()[0]
    count = RequestCount()
    dataset = DatasetLog("/data/bench.jsonl", sha256_json("data"), 100)
    with harness.scratch("register") as (home, services):
        server = harness.start_registry(home / "guarded", services)
        registry = Registry(server.url)
        warm_up = policy("warm-up", 1)
        _, first_sent = count.during(
            lambda: registry.revisions.register(
                warm_up, "mint-local://sha256/" + "0" * 64, BASE_DIGEST
            )
        )
        kinds: dict[str, tuple[list[float], list[int]]] = {kind: ([], []) for kind in KINDS}
        for n in range(args.revisions):
            for kind in harness.alternating(n, KINDS):
                adapter = f"bench-{kind}-{n % args.adapters}"
                record = policy(adapter, n // args.adapters + 1)
                uri = "mint-local://sha256/" + record.content_digest.removeprefix("sha256:")
                run_id = None
                if kind == "trained":  # what training made, before the clock starts
                    run_id = registry.runs.start_training(adapter, {"rank": "8"}, dataset)
                    registry.runs.finish_training(run_id, record.eval_metrics, 400)
                times, sent = kinds[kind]
                seconds, requests_sent = count.during(
                    lambda: registry.revisions.register(record, uri, BASE_DIGEST, run_id)  # noqa: B023
                )
                times.append(seconds)
                sent.append(requests_sent)
        # Without authentication: only as the baseline of what authentication adds.
        open_server = start_mlflow(home / "unguarded")
        services.append(open_server)
        assert server.accounts is not None
        costs = request_costs(server.url, open_server.url, server.accounts, args.requests)

    imported, trained = (summary(*kinds[kind]) for kind in KINDS)
    p50 = imported["p50_s"]
    print(f"register over {args.revisions} revisions of each kind ({args.adapters} adapters), "
          "real mlflow server:")  # fmt: skip
    for kind, figures in (("imported", imported), ("trained", trained)):
        print(f"  {kind:<9} p50 {figures['p50_s'] * 1e3:.0f} ms   "
              f"p95 {figures['p95_s'] * 1e3:.0f} ms   "
              f"MLflow requests {figures['requests_median']:g} "
              f"({figures['requests_min']}-{figures['requests_max']})")  # fmt: skip
    print(f"  first registration in the process (a new adapter): {first_sent} requests")
    print(f"  reference {REFERENCE_S:.2f} s -> {REFERENCE_S / p50:.1f}x faster at p50")
    auth = {case: read_figures(costs[case]) for case in AUTH_CASES}
    for case in AUTH_CASES:
        print(f"  one read, {case:<9}: p50 {auth[case]['p50_ms']:.1f} ms   "
              f"p99 {auth[case]['p99_ms']:.1f} ms")  # fmt: skip
    added = {q: auth["signed in"][q] - auth["unguarded"][q] for q in ("p50_ms", "p99_ms")}
    print(f"  authentication adds p50 {added['p50_ms']:.1f} ms, p99 {added['p99_ms']:.1f} ms")
    result = {
        "revisions": args.revisions,
        "adapters": args.adapters,
        "register_p50_s": p50,
        "register_p95_s": imported["p95_s"],
        "requests_per_registration": imported["requests_median"],
        "trained_register_p50_s": trained["p50_s"],
        "trained_register_p95_s": trained["p95_s"],
        "trained_requests_per_registration": trained["requests_median"],
        "first_registration_requests": first_sent,
        "reference_s": REFERENCE_S,
        "reference_over_p50": REFERENCE_S / p50,
        "samples_s": kinds["imported"][0],
        "trained_samples_s": kinds["trained"][0],
        "requests_sent": kinds["imported"][1],
        "trained_requests_sent": kinds["trained"][1],
        "auth_requests": args.requests,
        "auth_added_p50_ms": added["p50_ms"],
        "auth_added_p99_ms": added["p99_ms"],
        "auth_over_refused_p50_ms": auth["signed in"]["p50_ms"] - auth["refused"]["p50_ms"],
        "auth_read_ms": auth,
        "auth_samples_s": costs,
        "load_average_1m": {"start": load_at_start, "end": os.getloadavg()[0]},
    }
    harness.write(args.out, result)


if __name__ == "__main__":
    main()
