"""Noisy-neighbour benchmark (issue 38): one worker, four principals with an adapter each in
closed loops, one of them (loud) with ten clients to the others' one, so it sends about ten
times their requests. Three runs side by side on the same worker process and load:

- **none**: today's order, every waiting request joins the batch in arrival order (a worker
  without API keys: everyone is one principal, which fair share serves first come, first served;
  a second worker process, the same in all else);
- **fair**: the worker with API keys, equal weights: waiting requests join by start-time fair
  queuing over tokens;
- **fair_quota**: fair share, and loud's generated tokens per minute capped (at half of what
  it generated under fair share) for `--quota-window` seconds; its clients wait each 429's
  Retry-After-Ms, then ask again.

The running batch takes `--max-batch` requests (4): fewer than the 13 clients, so requests wait
and the order they join in is what differs. Each quiet principal also runs alone, for its own
p95, and all four run once with one client each (`quiet_p95_ratio_equal`: the floor fair
share aims at, where loud is no louder than the others and each holds a row; above 1 by what a
batch of four costs each row over a batch of one). Figures: each run's worst quiet principal's
p95 over its p95 alone (`quiet_p95_ratio`),
fair share's tokens/s over today's (`throughput_ratio_fair`), loud's tokens per minute over its
quota minus 1 (`quota_error`), and for each 429 the time until that client's next request was
let in over the Retry-After it was given (`retry_after`). Last, a request quota shared by two
gateways (each enforces half, MINT_TENANCY_SHARES=2): loud's requests/s against it with its
clients spread evenly and 4 to 1 (`shared_quota`). Writes bench/results/noisy.json.

    .venv/bin/python bench/noisy.py       # about 9 minutes
    .venv/bin/python bench/noisy.py --window 6 --alone 3 --quota-window 8 --shared-window 4
"""

import dataclasses
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import harness
from bench.backends import production_adapters, wait_ready
from mint_core.access import ADMIN
from mint_core.config import MintConfig
from mint_core.tenancy import RELOAD_S
from serving.gateway import start_gateway
from serving.worker.server import start_worker

PROMPT = "benchmark noisy neighbours="
NEW_TOKENS = 16
QUIET = ("quiet-1", "quiet-2", "quiet-3")
LOUD = "loud"
LOUD_CLIENTS = 10
KEYS = {f"key-{p}": p for p in (*QUIET, LOUD)}


@dataclasses.dataclass
class Principal:
    name: str
    model: str
    clients: int
    latencies: list[float] = dataclasses.field(default_factory=list)
    tokens: int = 0
    waits: list[float] = dataclasses.field(default_factory=list)
    """Per 429: time until the same client's next request was let in, over Retry-After."""
    first_retry_admitted: list[bool] = dataclasses.field(default_factory=list)
    urls: list[str] = dataclasses.field(default_factory=list)
    """Where its client j sends, `urls[j % len(urls)]` (several gateways); none: `run`'s."""


def run(url: str, principals: list[Principal], window_s: float, keyed: bool) -> float:
    """Every principal's clients in closed loops on `url` for `window_s`; the tokens/s of all.
    A 429 is waited out as its Retry-After-Ms says, then asked again."""
    lock = threading.Lock()
    deadline = time.monotonic() + window_s

    def client(principal: Principal, number: int) -> None:
        key = next(k for k, p in KEYS.items() if p == principal.name)
        headers = {"Authorization": f"Bearer {key}"} if keyed else {}
        body = {"model": principal.model, "prompt": PROMPT, "max_tokens": NEW_TOKENS,
                "temperature": 0}  # fmt: skip
        refused: tuple[float, float] | None = None
        retries = 0
        at = principal.urls[number % len(principal.urls)] if principal.urls else url
        with httpx.Client(base_url=at, headers=headers, timeout=120) as http:
            while time.monotonic() < deadline:
                sent = time.monotonic()
                answer = http.post("/v1/completions", json=body)
                if answer.status_code == 429:
                    wait_s = int(answer.headers["Retry-After-Ms"]) / 1000
                    if refused is None:
                        refused = (sent, wait_s)
                    retries += 1
                    time.sleep(wait_s)
                    continue
                answer.raise_for_status()
                with lock:
                    principal.latencies.append(time.monotonic() - sent)
                    principal.tokens += answer.json()["usage"]["completion_tokens"]
                    if refused is not None:
                        principal.waits.append((sent - refused[0]) / max(refused[1], 1e-3))
                        principal.first_retry_admitted.append(retries == 1)
                refused, retries = None, 0

    clients = [(p, number) for p in principals for number in range(p.clients)]
    started = time.monotonic()
    with ThreadPoolExecutor(len(clients)) as pool:
        list(pool.map(lambda pair: client(*pair), clients))
    return sum(p.tokens for p in principals) / (time.monotonic() - started)


def p95(principal: Principal) -> float:
    return harness.percentile(principal.latencies, 0.95)


def retry_after(loud: Principal) -> dict[str, float | None]:
    """How the 429s' Retry-After compared with when each refused client was next let in."""
    waits = loud.waits
    return {
        "refusals": len(waits),
        "admitted_at_first_retry": sum(loud.first_retry_admitted) / max(len(waits), 1),
        "admitted_after_over_retry_after_p50": statistics.median(waits) if waits else None,
        "admitted_after_over_retry_after_p95": harness.percentile(waits, 0.95) if waits else None,
    }


def set_terms(path: Path, terms: dict[str, object]) -> None:
    path.write_text(json.dumps(terms))
    time.sleep(RELOAD_S * 1.5)  # the worker looks at the file at most every RELOAD_S


def main() -> None:
    parser = harness.command_line(__doc__, "noisy")
    parser.add_argument(
        "--window", type=float, default=45.0, help="seconds of the none and fair runs"
    )
    parser.add_argument("--alone", type=float, default=15.0, help="seconds of each quiet run alone")
    parser.add_argument("--quota-window", type=float, default=120.0, help="seconds of fair_quota")
    parser.add_argument("--shared-window", type=float, default=30.0, help="seconds per spread")
    parser.add_argument("--max-batch", type=int, default=4)
    args = parser.parse_args()

    with harness.scratch("noisy") as (home, services):
        config = MintConfig(home=home, max_batch=args.max_batch, device_slots=8)
        config, revisions, _, readers = production_adapters(config, 4, services)
        tenancy = home / "tenancy.json"
        tenancy.write_text("{}")
        governed = dataclasses.replace(
            config, api_keys=KEYS | {"key-admin": ADMIN}, worker_api_key="key-admin",
            tenancy_file=str(tenancy),
        )  # fmt: skip
        fair_worker = start_worker(governed, env=readers)
        fifo_worker = start_worker(config, env=readers)
        services += [fair_worker, fifo_worker]
        fair_fleet = wait_ready(governed, [fair_worker], revisions)
        wait_ready(config, [fifo_worker], revisions)
        models = [f"{r.adapter}@production" for r in revisions]

        def principals(loud_clients: int = LOUD_CLIENTS) -> list[Principal]:
            return [Principal(name, model, loud_clients if name == LOUD else 1)
                    for name, model in zip((*QUIET, LOUD), models, strict=True)]  # fmt: skip

        for url, keyed in ((fair_worker.url, True), (fifo_worker.url, False)):  # warm both
            run(url, principals(), 3.0, keyed)
        alone = {}
        for quiet in principals()[:3]:
            run(fair_worker.url, [quiet], args.alone, True)
            alone[quiet.name] = p95(quiet)
            print(f"alone  {quiet.name}: p95 {1000 * alone[quiet.name]:7.1f} ms")

        runs: dict[str, list[Principal]] = {}
        tok_s: dict[str, float] = {}
        for name, url, keyed, window in (
            ("none", fifo_worker.url, False, args.window),
            ("fair", fair_worker.url, True, args.window),
        ):
            runs[name] = principals()
            tok_s[name] = run(url, runs[name], window, keyed)
        # The floor fair share aims at: loud no louder than the others (one client), so each
        # principal holds a row of the batch of 4 and no scheduling decision is left to make.
        equal = principals(loud_clients=1)
        run(fair_worker.url, equal, args.window, True)
        loud_fair_per_min = runs["fair"][3].tokens / args.window * 60
        quota = round(loud_fair_per_min / 2)
        set_terms(tenancy, {"principals": {LOUD: {"generated_tokens_per_min": quota}}})
        runs["fair_quota"] = principals()
        tok_s["fair_quota"] = run(fair_worker.url, runs["fair_quota"], args.quota_window, True)

        # A request quota shared by two gateways, each enforcing half (MINT_TENANCY_SHARES=2),
        # loud's clients spread over them evenly and 4 to 1; the worker's own quota off.
        set_terms(tenancy, {})
        rate = round(len(runs["fair"][3].latencies) / args.window / 2, 2)
        split_terms = home / "gateway-tenancy.json"
        split_terms.write_text(json.dumps({"principals": {LOUD: {"requests_per_s": rate}}}))
        gateway_config = dataclasses.replace(
            fair_fleet, api_keys=governed.api_keys, tenancy_file=str(split_terms),
            tenancy_shares=2,
        )  # fmt: skip
        gateways = [start_gateway(gateway_config, env=readers) for _ in range(2)]
        services += gateways
        shared = {}
        for spread, picks in (("even", (0, 1)), ("uneven", (0, 0, 0, 0, 1))):
            loud = Principal(LOUD, models[3], LOUD_CLIENTS, urls=[gateways[i].url for i in picks])
            run(fair_worker.url, [loud], args.shared_window, True)
            shared[spread] = len(loud.latencies) / args.shared_window / rate - 1
            print(f"shared {spread:7s}: loud {len(loud.latencies) / args.shared_window:.2f} "
                  f"requests/s against {rate:.2f}")  # fmt: skip

    ratios = {name: {q.name: p95(q) / alone[q.name] for q in ps[:3]} for name, ps in runs.items()}
    windows = {"none": args.window, "fair": args.window, "fair_quota": args.quota_window}
    loud_per_min = runs["fair_quota"][3].tokens / args.quota_window * 60
    for name, ps in runs.items():
        print(
            f"{name:10s} {tok_s[name]:7.1f} tok/s  quiet p95 / alone: "
            + "  ".join(f"{q}={r:.2f}" for q, r in ratios[name].items())
            + f"  loud {ps[3].tokens / windows[name] * 60:,.0f} tok/min"
        )
    summary = {
        "quiet_p95_ratio": {name: max(r.values()) for name, r in ratios.items()},
        "quiet_p95_ratios": ratios,
        "quiet_p95_ratio_equal": max(p95(q) / alone[q.name] for q in equal[:3]),
        "quiet_p95_alone_ms": {q: 1000 * s for q, s in alone.items()},
        "p95_ms": {name: {p.name: 1000 * p95(p) for p in ps} for name, ps in runs.items()},
        "requests": {name: {p.name: len(p.latencies) for p in ps} for name, ps in runs.items()},
        "tok_s": tok_s,
        "throughput_ratio_fair": tok_s["fair"] / tok_s["none"],
        "loud_quota_tokens_per_min": quota,
        "loud_tokens_per_min": loud_per_min,
        "quota_error": loud_per_min / quota - 1,
        "shared_quota": {"requests_per_s": rate, "gateways": 2, "error": shared},
        "retry_after": retry_after(runs["fair_quota"][3]),
        "max_batch": args.max_batch,
        "loud_clients": LOUD_CLIENTS,
        "new_tokens": NEW_TOKENS,
        "window_s": args.window,
        "quota_window_s": args.quota_window,
        "machine": harness.machine(),
    }
    print(
        f"\nworst quiet p95 / alone: none {summary['quiet_p95_ratio']['none']:.2f}, fair "
        f"{summary['quiet_p95_ratio']['fair']:.2f}, fair_quota "
        f"{summary['quiet_p95_ratio']['fair_quota']:.2f} (all four alike, one client each: "
        f"{summary['quiet_p95_ratio_equal']:.2f}); throughput fair / none "
        f"{summary['throughput_ratio_fair']:.3f}; loud {loud_per_min:,.0f} tokens/min against "
        f"its quota of {quota:,} (error {100 * summary['quota_error']:+.1f}%); "
        f"{summary['retry_after']}"
    )
    harness.write(args.out, summary)


if __name__ == "__main__":
    main()
