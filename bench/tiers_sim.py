"""Tiers simulation: MinT's own placement, demand and host-tier eviction code at a fleet's scale,
driven by a simulated clock and a Zipf trace (no I/O, no model).

A fleet of `--workers` workers of one base (host tier `--host` revisions, `--device` device
slots each) serves `--requests` Poisson arrivals (`--rate` per worker per second) over
`--adapters` revisions whose popularity is Zipf with exponent s, for each s of `--zipf`. Rank
maps to revision through a seeded permutation, so hash and popularity are unrelated. The code
driven is `mint_core.planning.placement` (`place`, `ranking`, `Demand`) and
`mint_core.planning.residency.Residency`, one per worker, both on the simulated clock. What the
simulation adds is the fleet around them, as the gateway and the workers behave:

- the gateway asks `Demand` for the revision's replicas (its own setting 1); one replica: the
  worker `place` picks; more: of its top-ranked workers, the least loaded (requests in flight)
  where it is ready, else the first. With more than one replica, the placed workers that lack
  it are told to admit it (demand admission on its placement);
- on the chosen worker, a ready revision (in the host tier, prewarm over) is a hit: `acquire`
  and `release` of a device slot, back to back; the request stays in flight for `--service-s`
  (for `Demand` and the least-loaded choice);
- anything else is a miss: the worker answers 503 and, unless it is already queued or warming,
  admits it (`put_host`, then `settle` after `--prewarm-s`: requests for it meanwhile miss
  too), at once (`--admission-k 0`, the main runs: the cache policy alone) or through MinT's
  `AdmissionQueue` with demand priority, K prewarms at a time per worker (`--admission-ks`,
  run at `--sweep-zipf`). The client retries after the wait the worker suggests
  (`ReadinessTable.wait_estimate`'s rule: its place in the queue times the prewarm); retries
  are routed like any request but counted apart (the hit ratio is over first attempts, the
  comparison's requests), and each counted request's cold wait (first refusal to being
  served) is kept.

Figures, each s, after the first `--warmup` share of the trace (uncounted; the caches start
empty):

1. host-tier hit ratio of first attempts: MinT's (LRFU) against Belady's offline optimum (evict
   the revision used again farthest ahead) and plain LRU on the identical per-worker request
   sequences, same capacity, loads instantaneous; the device tier's hit ratio (`counters`);
2. load imbalance, max/mean first attempts per worker: with `Demand`'s replicas (the run), and
   without (every request to `place`'s one worker, the same trace);
   and, as the bound an online policy approaches under independent requests, a cache holding
   each worker's most requested revisions of the counted part throughout (chosen in hindsight);
3. movement: the share of `--moves` sampled revisions whose placement changes when a worker
   joins (N -> N+1) or leaves (N -> N-1), against 1/N; and the share of the run's host hits
   that were on the leaving worker;
4. speed: `place` calls per second over N workers (the gateway's hot path; uncached).

`--half-lives` repeats MinT's run at s = `--sweep-zipf` with other LRFU half-lives (the Residency's
`half_life_s`), for choosing its default; `--admission-ks` with admission limited to K
prewarms at a time per worker (cold wait p50/p99: is admission keeping up?). Prints a table,
writes bench/results/tiers_sim.json.

    .venv/bin/python bench/tiers_sim.py                    # full: 10^6 adapters, 2 M requests per s
    .venv/bin/python bench/tiers_sim.py --adapters 20000 --workers 10 --requests 60000 \\
        --moves 5000 --zipf 1.0 --half-lives 30     # smoke (seconds)
"""

import heapq
import os
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from bench import harness
from mint_core.planning.admission import AdmissionQueue, Priority
from mint_core.planning.placement import Demand, place, ranking
from mint_core.planning.residency import DEFAULT_HALF_LIFE_S, HostTierFull, Residency, Tier

MAX_RETRIES = 100
HOT_RATE = 20.0
"""`MintConfig.hot_rate`'s default: requests per second per replica."""
# Event kinds, in the order they run at one instant: a prewarm settles before the retry that
# waited for it.
_FINISH, _SETTLE, _RETRY = 0, 1, 2


def worker_names(count: int) -> list[str]:
    return [f"http://worker-{n:03d}.mint:8000" for n in range(count)]


def revision_names(count: int) -> list[str]:
    return [f"adapter-{n:07d}:r1" for n in range(count)]


def revision_number(name: str) -> int:
    return int(name[len("adapter-") : -len(":r1")])


def placements(trace: np.ndarray, names: list[str], workers: list[str],
               placed: dict[int, int]) -> np.ndarray:  # fmt: skip
    """The one worker `place` gives each request's revision (memoised in `placed`)."""
    index = {name: n for n, name in enumerate(workers)}
    for revision in np.unique(trace).tolist():
        if revision not in placed:
            placed[revision] = index[place(names[revision], workers)[0]]
    return np.array([placed[r] for r in trace.tolist()], dtype=np.int32)


def zipf_trace(
    adapters: int, requests: int, s: float, rate: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Revision indices (Zipf over rank, rank -> revision by a seeded permutation) and arrival
    times (Poisson at `rate` per second)."""
    rng = np.random.default_rng(seed)
    weights = np.arange(1, adapters + 1, dtype=np.float64) ** -s
    cumulative = np.cumsum(weights / weights.sum())
    ranks = np.minimum(np.searchsorted(cumulative, rng.random(requests)), adapters - 1)
    permutation = rng.permutation(adapters)
    times = np.cumsum(rng.exponential(1.0 / rate, requests))
    return permutation[ranks], times


@dataclass
class Run:
    """One MinT run's outcome."""

    worker_of: np.ndarray
    """The worker each first attempt went to."""
    hits: int
    misses: int
    misses_warming: int
    """Misses while the revision was already warming on that worker."""
    retries: int
    retry_hits: int
    refused: int
    """Admissions refused (HostTierFull)."""
    gave_up: int
    replica_admissions: int
    loads: int
    max_replicas: int
    device_hits: int
    device_misses: int
    hits_by_worker: list[int]
    wall_s: float
    cold_waits: list[float]
    """Counted requests refused at first: seconds from the first refusal to being served."""


def simulate(
    trace: np.ndarray,
    times: np.ndarray,
    names: list[str],
    workers: list[str],
    host: int,
    device: int,
    warmup: int,
    half_life_s: float,
    prewarm_s: float,
    service_s: float,
    placed: dict[int, int],
    admission_k: int = 0,
) -> Run:
    """The fleet around MinT's code (see the module's docstring), over one trace. Each worker
    prewarms `admission_k` revisions at a time through MinT's `AdmissionQueue` (demand
    priority), the rest queued; 0: every admission starts at once."""
    now = [0.0]

    def clock() -> float:
        return now[0]

    count = len(workers)
    tiers = [
        Residency[None](
            host_capacity_bytes=host,
            device_slots=device,
            host_capacity_entries=host,
            half_life_s=half_life_s,
            clock=clock,
        )
        for _ in workers
    ]
    demand = Demand(hot_rate=HOT_RATE, clock=clock)
    queues = [AdmissionQueue[int](admission_k) for _ in workers] if admission_k else None
    index = {name: n for n, name in enumerate(workers)}
    ranked: dict[int, list[int]] = {}  # revision -> workers in its order, for the hot ones
    holders: dict[int, set[int]] = {}  # revision -> workers whose host tier holds it
    warming: list[set[int]] = [set() for _ in workers]
    in_flight = [0] * count
    hits_by_worker = [0] * count
    events: list[tuple[float, int, int, int, int, int]] = []
    origins: dict[int, float] = {}
    """A retry event's sequence number -> when its counted request was first refused."""
    cold_waits: list[float] = []
    """Counted requests refused at first: first refusal to the retry that was served."""
    sequence = 0
    worker_of = np.empty(len(trace), dtype=np.int32)
    stats = dict.fromkeys(
        ("hits", "misses", "misses_warming", "retries", "retry_hits", "refused", "gave_up",
         "replica_admissions", "max_replicas"), 0)  # fmt: skip
    device_before = (0, 0)

    def admit(worker: int, revision: int, at: float) -> bool:
        """Admit `revision` on `worker` by demand: at once, or queued behind K prewarms."""
        if queues is None:
            return prewarm(worker, revision, at)
        if revision in warming[worker]:
            return False
        queues[worker].push(revision, Priority.DEMAND)
        warming[worker].add(revision)  # queued: not ready, not admitted again
        start_queued(worker, at)
        return True

    def start_queued(worker: int, at: float) -> None:
        assert queues is not None
        while (revision := queues[worker].start_next()) is not None:
            if not prewarm(worker, revision, at):
                queues[worker].finish(revision)
                warming[worker].discard(revision)

    def prewarm(worker: int, revision: int, at: float) -> bool:
        nonlocal sequence
        try:
            evicted = tiers[worker].put_host(names[revision], None, 1)
        except HostTierFull:
            stats["refused"] += 1
            return False
        for key in evicted:
            holders[revision_number(key)].discard(worker)
        holders.setdefault(revision, set()).add(worker)
        warming[worker].add(revision)
        sequence += 1
        heapq.heappush(events, (at + prewarm_s, _SETTLE, sequence, worker, revision, 0))
        return True

    def wait_s(worker: int, revision: int) -> float:
        """The wait a "not ready" answer suggests: `ReadinessTable.wait_estimate`'s rule."""
        if queues is None:
            return prewarm_s
        position = queues[worker].position(revision)
        return prewarm_s if position is None else (position // admission_k + 1) * prewarm_s

    def request(
        revision: int, at: float, attempt: int, counted: bool, origin: float | None = None
    ) -> int:
        """Route and serve one request; the worker it went to. `origin`: when a counted
        request was first refused, for its retries (its cold wait ends at the hit)."""
        nonlocal sequence
        name = names[revision]
        demand.started(name)
        replicas = demand.replicas(name, 1, count)
        if replicas == 1:
            worker = placed.get(revision)
            if worker is None:
                worker = placed[revision] = index[place(name, workers)[0]]
        else:
            order = ranked.get(revision)
            if order is None:
                order = ranked[revision] = [index[w] for w in ranking(name, workers)]
            top = order[:replicas]
            held = holders.get(revision, ())
            ready = [w for w in top if w in held and revision not in warming[w]]
            worker = min(ready, key=in_flight.__getitem__) if ready else top[0]
            for other in top:
                if other not in held and other != worker:
                    stats["replica_admissions"] += admit(other, revision, at)
            stats["max_replicas"] = max(stats["max_replicas"], replicas)
        tier = tiers[worker]
        if revision not in warming[worker] and tier.in_host(name):
            tier.acquire(name)
            tier.release(name)
            in_flight[worker] += 1
            sequence += 1
            heapq.heappush(events, (at + service_s, _FINISH, sequence, worker, revision, 0))
            if counted:
                stats["hits"] += 1
                hits_by_worker[worker] += 1
            elif attempt > 0:
                stats["retry_hits"] += 1
                if origin is not None:
                    cold_waits.append(at - origin)
            return worker
        demand.finished(name)  # a 503 is answered at once
        if counted:
            stats["misses"] += 1
            stats["misses_warming"] += revision in warming[worker]
        if revision not in warming[worker]:
            admit(worker, revision, at)
        if attempt < MAX_RETRIES:
            sequence += 1
            retry_at = at + wait_s(worker, revision)
            heapq.heappush(events, (retry_at, _RETRY, sequence, worker, revision, attempt + 1))
            if counted or origin is not None:
                origins[sequence] = at if counted else origin
        else:
            stats["gave_up"] += 1
        return worker

    def run_events(until: float) -> None:
        while events and events[0][0] <= until:
            at, kind, number, worker, revision, attempt = heapq.heappop(events)
            now[0] = at
            if kind == _FINISH:
                in_flight[worker] -= 1
                demand.finished(names[revision])
            elif kind == _SETTLE:
                warming[worker].discard(revision)
                tiers[worker].settle(names[revision])
                if queues is not None:
                    queues[worker].finish(revision)
                    start_queued(worker, at)
            else:
                stats["retries"] += 1
                request(revision, at, attempt, counted=False, origin=origins.pop(number, None))

    start = time.perf_counter()
    for position, (revision, at) in enumerate(zip(trace.tolist(), times.tolist(), strict=True)):
        if position == warmup:
            device_before = device_counts(tiers)
        run_events(at)
        now[0] = at
        worker_of[position] = request(revision, at, 0, counted=position >= warmup)
    run_events(float("inf"))
    wall_s = time.perf_counter() - start
    device_hits, device_misses = device_counts(tiers)
    return Run(
        worker_of=worker_of,
        loads=sum(t.counters[Tier.HOST].loads for t in tiers),
        device_hits=device_hits - device_before[0],
        device_misses=device_misses - device_before[1],
        hits_by_worker=hits_by_worker,
        wall_s=wall_s,
        cold_waits=cold_waits,
        **stats,
    )


def device_counts(tiers: list[Residency[None]]) -> tuple[int, int]:
    return (
        sum(t.counters[Tier.DEVICE].hits for t in tiers),
        sum(t.counters[Tier.DEVICE].misses for t in tiers),
    )


def belady_hits(sequence: np.ndarray, capacity: int, counted: np.ndarray) -> int:
    """Hits of the offline optimum on `sequence` (evict the entry used again farthest ahead),
    counting only where `counted`."""
    length = len(sequence)
    # next_use[i]: the next position of sequence[i], or `length` (never again).
    order = np.argsort(sequence, kind="stable")
    next_use = np.full(length, length, dtype=np.int64)
    same = sequence[order[1:]] == sequence[order[:-1]]
    next_use[order[:-1][same]] = order[1:][same]
    cache: dict[int, int] = {}  # key -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, key); stale entries skipped
    hits = 0
    for key, upcoming, count in zip(
        sequence.tolist(), next_use.tolist(), counted.tolist(), strict=True
    ):
        if key in cache:
            hits += count
        elif len(cache) >= capacity:
            while True:
                farthest, victim = heapq.heappop(heap)
                if cache.get(victim) == -farthest:
                    del cache[victim]
                    break
        cache[key] = upcoming
        heapq.heappush(heap, (-upcoming, key))
        if len(heap) > 4 * capacity + 64:  # drop stale entries now and then
            heap = [(-u, k) for k, u in cache.items()]
            heapq.heapify(heap)
    return hits


def lru_hits(sequence: np.ndarray, capacity: int, counted: np.ndarray) -> int:
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for key, count in zip(sequence.tolist(), counted.tolist(), strict=True):
        if key in cache:
            hits += count
            cache.move_to_end(key)
        else:
            cache[key] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits


def static_hits(sequence: np.ndarray, capacity: int) -> int:
    """Hits of a cache holding, throughout, the `capacity` revisions most requested in
    `sequence` (chosen in hindsight): under independent requests, what the best online policy
    (perfect LFU) approaches."""
    _, counts = np.unique(sequence, return_counts=True)
    return int(np.sort(counts)[::-1][:capacity].sum())


def offline(
    trace: np.ndarray, worker_of: np.ndarray, workers: int, host: int, warmup: int
) -> tuple[int, int, int]:
    """Belady's, LRU's and the static top-`host`'s hits over the counted first attempts, per
    worker, same capacity."""
    order = np.argsort(worker_of, kind="stable")
    bounds = np.searchsorted(worker_of[order], np.arange(workers + 1))
    belady = lru = static = 0
    for w in range(workers):
        positions = order[bounds[w] : bounds[w + 1]]
        sequence, counted = trace[positions], (positions >= warmup).astype(np.int64)
        belady += belady_hits(sequence, host, counted)
        lru += lru_hits(sequence, host, counted)
        static += static_hits(sequence[positions >= warmup], host)
    return belady, lru, static


def imbalance(counts: np.ndarray) -> float:
    return float(counts.max() / counts.mean())


def movement(names: list[str], workers: list[str], sample: int, seed: int) -> dict[str, Any]:
    """Placement changes when a worker joins or leaves, over `sample` revisions; and place()'s
    speed (the first pass, uncached)."""
    rng = np.random.default_rng(seed + 1)
    revisions = [
        names[r]
        for r in rng.choice(len(names), size=min(sample, len(names)), replace=False).tolist()
    ]
    start = time.perf_counter()
    before = [place(r, workers)[0] for r in revisions]
    place_s = time.perf_counter() - start
    joined = [*workers, f"http://worker-{len(workers):03d}.mint:8000"]
    leaving = workers[int(rng.integers(len(workers)))]
    left = [w for w in workers if w != leaving]
    after_join = [place(r, joined)[0] for r in revisions]
    after_leave = [place(r, left)[0] for r in revisions]
    moved_join = [b != a for b, a in zip(before, after_join, strict=True)]
    moved_leave = [b != a for b, a in zip(before, after_leave, strict=True)]
    start = time.perf_counter()
    for r in revisions[:2000]:
        ranking(r, workers)
    ranking_s = (time.perf_counter() - start) / min(2000, len(revisions))
    return {
        "revisions": len(revisions),
        "moved_on_join": sum(moved_join) / len(revisions),
        "moved_on_join_expected": 1 / len(joined),
        # Rendezvous: a join moves revisions only to the new worker; a leave only the
        # leaving worker's own.
        "join_moves_only_to_new": all(
            a == joined[-1] for a, m in zip(after_join, moved_join, strict=True) if m
        ),
        "moved_on_leave": sum(moved_leave) / len(revisions),
        "moved_on_leave_expected": 1 / len(workers),
        "leave_moves_only_its_own": all(
            b == leaving for b, m in zip(before, moved_leave, strict=True) if m
        ),
        "leaving_worker": workers.index(leaving),
        "place_per_s": len(revisions) / place_s,
        "place_us": place_s / len(revisions) * 1e6,
        "ranking_us": ranking_s * 1e6,
    }


def figures(run: Run, trace: np.ndarray, workers: list[str], host: int, warmup: int,
            placed_without: np.ndarray, leaving: int) -> dict[str, Any]:  # fmt: skip
    counted = run.hits + run.misses
    start = time.perf_counter()
    belady, lru, static = offline(trace, run.worker_of, len(workers), host, warmup)
    offline_s = time.perf_counter() - start
    with_replicas = np.bincount(run.worker_of[warmup:], minlength=len(workers))
    without = np.bincount(placed_without[warmup:], minlength=len(workers))
    device = run.device_hits + run.device_misses
    return {
        "requests_counted": counted,
        "host_hit_ratio": run.hits / counted,
        "belady_hit_ratio": belady / counted,
        "lru_hit_ratio": lru / counted,
        "static_top_hit_ratio": static / counted,
        "mint_over_belady": run.hits / belady if belady else None,
        "mint_over_lru": run.hits / lru if lru else None,
        "misses_while_warming": run.misses_warming,
        "device_hit_ratio": run.device_hits / device if device else None,
        "imbalance_with_replicas": imbalance(with_replicas),
        "imbalance_without_replicas": imbalance(without),
        "max_replicas": run.max_replicas,
        "replica_admissions": run.replica_admissions,
        "host_loads": run.loads,
        "host_loads_per_worker_per_s": None,
        "retries": run.retries,
        "retry_hits": run.retry_hits,
        "admissions_refused": run.refused,
        "gave_up": run.gave_up,
        "hits_lost_on_leave": run.hits_by_worker[leaving] / max(1, sum(run.hits_by_worker)),
        "cold_wait_p50_s": harness.percentile(run.cold_waits, 0.5) if run.cold_waits else None,
        "cold_wait_p99_s": harness.percentile(run.cold_waits, 0.99) if run.cold_waits else None,
        "distinct_revisions": len(np.unique(trace)),
        "sim_s": run.wall_s,
        "offline_s": offline_s,
    }


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main() -> None:
    parser = harness.command_line(__doc__, "tiers_sim")
    parser.add_argument("--adapters", type=int, default=1_000_000, help="revisions (Zipf ranks)")
    parser.add_argument("--workers", type=int, default=100)
    parser.add_argument("--host", type=int, default=100, help="host-tier revisions per worker")
    parser.add_argument("--device", type=int, default=64, help="device slots per worker")
    parser.add_argument("--requests", type=int, default=2_000_000, help="trace length per s")
    parser.add_argument("--warmup", type=float, default=1 / 3, help="share of the trace uncounted")
    parser.add_argument("--rate", type=float, default=50.0, help="requests/s per worker")
    parser.add_argument("--prewarm-s", type=float, default=0.2, help="a demand admission's prewarm")
    parser.add_argument("--service-s", type=float, default=0.05, help="a served request's time")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--zipf", type=float, nargs="+", default=[0.8, 1.0, 1.2], help="s values")
    parser.add_argument("--half-life", type=float, default=DEFAULT_HALF_LIFE_S,
                        help="the host tier's LRFU half-life for the main runs")  # fmt: skip
    parser.add_argument("--half-lives", type=float, nargs="*", default=[30.0, 3000.0],
                        help="other LRFU half-lives, run at --sweep-zipf")  # fmt: skip
    parser.add_argument("--sweep-zipf", type=float, default=1.0, help="the s of --half-lives")
    parser.add_argument("--moves", type=int, default=200_000, help="revisions sampled for movement")
    parser.add_argument(
        "--admission-k", type=int, default=0, help="prewarms at once per worker (0: no limit)"
    )
    parser.add_argument(
        "--admission-ks", type=int, nargs="*", default=[1, 4], help="others, at --sweep-zipf"
    )
    args = parser.parse_args()

    load_at_start = os.getloadavg()[0]
    workers = worker_names(args.workers)
    names = revision_names(args.adapters)
    warmup = int(args.requests * args.warmup)
    settings = {key: value for key, value in vars(args).items() if key != "out"}
    settings.update(hot_rate=HOT_RATE, max_retries=MAX_RETRIES, warmup_requests=warmup)

    moves = movement(names, workers, args.moves, args.seed)
    print(f"movement over {moves['revisions']:,} revisions: join {args.workers}->"
          f"{args.workers + 1} moves {moves['moved_on_join']:.4f} (1/N = "
          f"{moves['moved_on_join_expected']:.4f}), leave {args.workers}->{args.workers - 1} "
          f"moves {moves['moved_on_leave']:.4f} (1/N = {moves['moved_on_leave_expected']:.4f}); "
          f"place() {moves['place_us']:.1f} us ({moves['place_per_s']:,.0f}/s), ranking() "
          f"{moves['ranking_us']:.1f} us", flush=True)  # fmt: skip

    placed: dict[int, int] = {}  # revision -> its one worker: place()'s answers, memoised
    by_zipf: dict[str, Any] = {}
    sweep: dict[str, Any] = {}
    admission: dict[str, Any] = {}
    for number, s in enumerate(args.zipf):
        trace, times = zipf_trace(args.adapters, args.requests, s, args.rate * args.workers,
                                  args.seed + number)  # fmt: skip
        sweeping = s == args.sweep_zipf
        runs = [(args.half_life, args.admission_k)]
        if sweeping:
            runs += [(half_life, args.admission_k) for half_life in args.half_lives]
            runs += [(args.half_life, k) for k in args.admission_ks]
        placed_without = placements(trace, names, workers, placed)
        for half_life, admission_k in runs:
            run = simulate(trace, times, names, workers, args.host, args.device, warmup,
                           half_life, args.prewarm_s, args.service_s, placed,
                           admission_k)  # fmt: skip
            result = figures(run, trace, workers, args.host, warmup, placed_without,
                             moves["leaving_worker"])  # fmt: skip
            simulated_s = float(times[-1] - times[warmup])
            result["host_loads_per_worker_per_s"] = run.loads / args.workers / float(times[-1])
            result["simulated_s"] = float(times[-1])
            result["counted_simulated_s"] = simulated_s
            result["half_life_s"] = half_life
            result["admission_k"] = admission_k
            r = result
            print(f"s={s} half-life {half_life:g} s, admission K {admission_k or 'unlimited'}: "
                  f"host hit {r['host_hit_ratio']:.4f} (Belady "
                  f"{r['belady_hit_ratio']:.4f}, LRU {r['lru_hit_ratio']:.4f}, static top "
                  f"{r['static_top_hit_ratio']:.4f}), device hit {r['device_hit_ratio']:.4f}, "
                  f"imbalance {r['imbalance_with_replicas']:.2f} (without replicas "
                  f"{r['imbalance_without_replicas']:.2f}), cold wait p50 "
                  f"{seconds(r['cold_wait_p50_s'])} p99 {seconds(r['cold_wait_p99_s'])}; sim "
                  f"{run.wall_s:.0f} s, offline {r['offline_s']:.0f} s", flush=True)  # fmt: skip
            if admission_k != args.admission_k:
                admission[str(admission_k)] = result
            elif half_life == args.half_life:
                by_zipf[str(s)] = result
            else:
                sweep[f"{half_life:g}"] = result
        if sweeping:
            sweep[f"{args.half_life:g}"] = by_zipf[str(s)]

    print()
    print("| s | MinT host hit | Belady | MinT/Belady | LRU | static top | device hit | "
          "imbalance (replicas) | imbalance (none) | max replicas |")  # fmt: skip
    print("|" + " --- |" * 10)
    for s, r in by_zipf.items():
        print(f"| {s} | {r['host_hit_ratio']:.4f} | {r['belady_hit_ratio']:.4f} | "
              f"{r['mint_over_belady']:.3f} | {r['lru_hit_ratio']:.4f} | "
              f"{r['static_top_hit_ratio']:.4f} | {r['device_hit_ratio']:.4f} | "
              f"{r['imbalance_with_replicas']:.2f} | {r['imbalance_without_replicas']:.2f} | "
              f"{r['max_replicas']} |")  # fmt: skip
    if len(sweep) > 1:
        print()
        print(f"LRFU half-life at s={args.sweep_zipf}:")
        print("| half-life s | MinT host hit | MinT/Belady | MinT/LRU | MinT/static top |")
        print("| --- | --- | --- | --- | --- |")
        for half_life, r in sorted(sweep.items(), key=lambda item: float(item[0])):
            print(f"| {half_life} | {r['host_hit_ratio']:.4f} | {r['mint_over_belady']:.3f} | "
                  f"{r['mint_over_lru']:.3f} | "
                  f"{r['host_hit_ratio'] / r['static_top_hit_ratio']:.3f} |")  # fmt: skip
    if admission:
        print()
        print(f"Admission at s={args.sweep_zipf} (prewarms at once per worker):")
        print("| K | MinT host hit | cold wait p50 s | cold wait p99 s | refused |")
        print("| --- | --- | --- | --- | --- |")
        unlimited = by_zipf.get(str(args.sweep_zipf))
        rows = [("unlimited", unlimited)] if unlimited and not args.admission_k else []
        for k, r in [*rows, *sorted(admission.items(), key=lambda item: int(item[0]))]:
            print(f"| {k} | {r['host_hit_ratio']:.4f} | {seconds(r['cold_wait_p50_s'])} | "
                  f"{seconds(r['cold_wait_p99_s'])} | {r['admissions_refused']} |")  # fmt: skip
    print()
    print("| movement | moved | 1/N |\n| --- | --- | --- |")
    print(f"| join {args.workers}->{args.workers + 1} | {moves['moved_on_join']:.4f} | "
          f"{moves['moved_on_join_expected']:.4f} |")  # fmt: skip
    print(f"| leave {args.workers}->{args.workers - 1} | {moves['moved_on_leave']:.4f} | "
          f"{moves['moved_on_leave_expected']:.4f} |")  # fmt: skip
    harness.write(args.out, {
        "settings": settings,
        "by_zipf": by_zipf,
        "half_life_sweep": {"zipf": args.sweep_zipf, "by_half_life_s": sweep},
        "admission_sweep": {"zipf": args.sweep_zipf, "by_admission_k": admission},
        "movement": moves,
        "machine": {
            "cpu": harness.cpu_name(),
            "cpus": os.cpu_count(),
            "load_average_1m_at_start": load_at_start,
            "load_average_1m_at_end": os.getloadavg()[0],
        },
    })  # fmt: skip


if __name__ == "__main__":
    main()
