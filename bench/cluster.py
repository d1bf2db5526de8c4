"""Cluster benchmark: MinT as its users deploy it, each role on its own host, and what happens
when hosts are cut off, slowed down or killed (issue 36).

The hosts are Linux network namespaces on one bridge, booted by the test cluster's own code
(tests/cluster/boot.py: ctl with MLflow on PostgreSQL and its accounts, Prefect with its auth
string and moto's S3; two train hosts, two serve hosts behind their relays, a gateway, a
client), so it needs root. The scenarios are the cluster tests' drivers
(tests/cluster/scenarios*.py), run in this order:

- release      a release started through ctl's Prefect API, run on a train host, seen by
               the client through the gateway: the time per stage;
- serve_cut    serve-2's link down under client load: recovery, failed requests, rejoin;
               each request's answer on a timeline around the cut;
- control_cut  ctl's link down: what the serve hosts and the gateway go on serving, the
               catch-up once it is back, a promotion;
- latency      20 ms between the gateway and the serve hosts: the gateway's added p50 and a
               promotion's activation, against no delay;
- leave        serve-2's `mint up` sent SIGTERM under client load with 110-token generations
               in flight, through its relay and then advertising its own URL: failed
               requests, in-flight generations completed; it is started again as booted;
- train_killed last (the killed host stays dead): the crashed run, nothing registered, the
               rerun on the other train host.

A scenario that fails is reported (`errors`) and the next runs; the exit status is then 1.
Writes bench/results/cluster.json and cluster.png (bench/README.md says what each figure
means). Several minutes on 2 cores.

    sudo .venv/bin/python bench/cluster.py
    sudo .venv/bin/python bench/cluster.py --only release latency
"""

import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import harness

SCENARIOS = ("release", "serve_cut", "control_cut", "latency", "leave", "train_killed")
"""The order they run in: a killed train host last, since it stays dead."""

REQUIRED = {
    "release": ("total_s", "stage_s", "flow_run_host"),
    "serve_cut": ("recovery_s", "failed_requests", "requests"),
    "control_cut": ("served_while_cut", "catch_up_s"),
    "train_killed": ("registered", "rerun_ok"),
    "latency": ("added_p50_ms_no_delay", "added_p50_ms_20ms"),
    "leave": ("failed_requests", "in_flight_completed"),
}
"""The figures every cluster.json carries (issue 36's closing note quotes them)."""

LINK_POLL_S = 0.01
IFF_UP = 0x1


class Figures(Protocol):
    """What a scenario driver returns: {scenario: its figures} for the JSON."""

    def as_json(self) -> dict[str, object]: ...


def missing(result: Mapping[str, Any]) -> list[str]:
    """The REQUIRED figures `result` lacks, as `scenario.figure`."""
    return [
        f"{scenario}.{key}"
        for scenario, keys in REQUIRED.items()
        for key in keys
        if key not in result.get(scenario, {})
    ]


class LinkWatch:
    """When a link went down and up, read from its flags in /sys every LINK_POLL_S (the
    scenario cuts and rejoins the host itself; this places its requests around the cut)."""

    def __init__(self, link: str) -> None:
        self._flags = Path(f"/sys/class/net/{link}/flags")
        self.changes: list[tuple[float, bool]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> "LinkWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        last = True
        while not self._stop.is_set():
            try:
                up = bool(int(self._flags.read_text(), 16) & IFF_UP)
            except (OSError, ValueError):
                up = last
            if up != last:
                self.changes.append((time.time(), up))
                last = up
            time.sleep(LINK_POLL_S)

    def first(self, up: bool) -> float | None:
        return next((t for t, state in self.changes if state == up), None)


def timeline(
    answers: Mapping[str, Sequence[Mapping[str, Any]]],
    cut_at: float,
    rejoined_at: float | None,
    worker_roles: Mapping[str, str],
    held: Sequence[str],
) -> dict[str, Any]:
    """Each client lane's requests (tests/cluster/load.py's lines) in seconds from the cut:
    when sent and answered, the status (None: no answer), which serve host answered, and how
    many attempts it took (a 503's Retry-After honoured)."""
    lanes = []
    for adapter, lines in sorted(answers.items()):
        ordered = sorted(lines, key=lambda a: a["t_start"])
        lanes.append({
            "adapter": adapter,
            "held_by_cut_host": adapter in held,
            "t_start_s": [round(a["t_start"] - cut_at, 3) for a in ordered],
            "t_end_s": [round(a["t_end"] - cut_at, 3) for a in ordered],
            "status": [a["status"] for a in ordered],
            "worker": [worker_roles.get(a["headers"].get("X-Mint-Worker", ""), "")
                       for a in ordered],
            "error": [a["error"] for a in ordered],
            "attempts": [a.get("attempts", 1) for a in ordered],
        })  # fmt: skip
    link_up = None if rejoined_at is None else round(rejoined_at - cut_at, 3)
    return {"link_up_s": link_up, "lanes": lanes}


def read_answers(folder: Path) -> dict[str, list[dict[str, Any]]]:
    """adapter -> the answers its client lane wrote to `folder` (drive.Client's <adapter>.jsonl)."""
    return {
        path.stem: [json.loads(line) for line in path.read_text().splitlines() if line]
        for path in sorted(folder.glob("*.jsonl"))
    }


def summarize(
    figures: Sequence[Figures],
    extra: Mapping[str, Mapping[str, Any]],
    errors: Mapping[str, str],
    settings: Mapping[str, Any],
    boot_s: Mapping[str, float],
    scenario_s: Mapping[str, float],
    machine: Mapping[str, Any],
) -> dict[str, Any]:
    """The JSON: each driver's figures under its scenario, with `extra` figures merged in
    (the serve cut's timeline), then the errors, settings, boot and scenario times, machine."""
    result: dict[str, Any] = {}
    for each in figures:
        for scenario, values in each.as_json().items():
            result[scenario] = {**dict(values), **extra.get(scenario, {})}  # type: ignore[call-overload]
    return result | {
        "errors": dict(errors),
        "missing": missing(result),
        "settings": dict(settings),
        "boot_s": {host: round(s, 2) for host, s in boot_s.items()},
        "scenario_s": {name: round(s, 2) for name, s in scenario_s.items()},
        "machine": dict(machine),
    }


def report(result: Mapping[str, Any]) -> None:
    for scenario in SCENARIOS:
        figures = result.get(scenario)
        if figures is None:
            print(f"{scenario}: {result['errors'].get(scenario, 'not run')}")
            continue
        shown = {k: v for k, v in figures.items() if k not in ("timeline", "notes")}
        print(f"{scenario}: {json.dumps(shown)}")
    if result["missing"]:
        print("missing figures:", ", ".join(result["missing"]))


def main() -> None:
    parser = harness.command_line(__doc__, "cluster")
    parser.add_argument("--only", nargs="+", choices=SCENARIOS, default=list(SCENARIOS),
                        help="these scenarios (still in the order above)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=20, help="training steps of the release")
    parser.add_argument("--home", type=Path, default=Path(".mint"), help="base model cache")
    args = parser.parse_args()

    from tests.cluster import netns

    reason = netns.unavailable()
    if reason is not None:
        print(f"bench/cluster.py cannot run here: {reason}", file=sys.stderr)
        sys.exit(2)
    home = args.home.absolute()
    home.mkdir(parents=True, exist_ok=True)
    load_at_start = os.getloadavg()[0]
    # SIGTERM and SIGHUP stop the run as Ctrl-C does (`harness.scratch`): the cluster is taken
    # down.
    with harness.scratch("cluster", parent=home) as (work, _):
        result = run(args, home, work)
    result["machine"]["load_average_1m_at_start"] = load_at_start
    report(result)
    harness.write(args.out, result)
    if result["errors"]:
        sys.exit(1)


def run(args: Any, home: Path, work: Path) -> dict[str, Any]:
    """Boot the cluster, run the chosen scenarios in order, and return the JSON."""
    from tests.cluster import roles, scenarios, scenarios_serving
    from tests.cluster.boot import booted_cluster

    figures: list[Figures] = []
    extra: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    scenario_s: dict[str, float] = {}
    boot_started = time.monotonic()
    with booted_cluster(home, work) as booted:
        print(f"cluster booted in {time.monotonic() - boot_started:.0f} s "
              f"(tag {booted.cluster.tag}): {json.dumps(booted.boot_s)}", flush=True)  # fmt: skip
        worker_roles = {url: role for role, url in booted.worker_urls.items()}

        def serve_cut() -> Figures:
            folder = work / "serve_cut"
            link = booted.cluster.host(roles.SERVE[1]).link
            with LinkWatch(link) as watch:
                done = scenarios_serving.serve_cut(booted, folder, cut_host=roles.SERVE[1])
            cut_at = watch.first(up=False)
            if cut_at is not None:
                held = done.notes.get("held", "").split(",")
                lanes = timeline(read_answers(folder), cut_at, watch.first(up=True),
                                 worker_roles, held)  # fmt: skip
                extra["serve_cut"] = {"timeline": lanes}
            return done

        drivers: dict[str, Callable[[], Figures]] = {
            "release": lambda: scenarios.release_across_hosts(
                booted, work / "release", steps=args.steps
            ),
            "serve_cut": serve_cut,
            "control_cut": lambda: scenarios_serving.control_cut(booted, work / "control_cut"),
            "latency": lambda: scenarios_serving.latency(booted, work / "latency"),
            "leave": lambda: scenarios_serving.serve_leave(booted, work / "leave"),
            "train_killed": lambda: scenarios.train_host_killed(booted),
        }
        for name in (s for s in SCENARIOS if s in args.only):
            print(f"--- {name}", flush=True)
            started = time.monotonic()
            try:
                done = drivers[name]()
            except Exception as e:  # reported in the JSON; the next scenario still runs
                traceback.print_exc()
                errors[name] = f"{type(e).__name__}: {e}"
            else:
                figures.append(done)
                print(json.dumps(done.as_json(), default=str)[:2000], flush=True)
            scenario_s[name] = time.monotonic() - started
        boot_s = booted.boot_s
    settings = {
        "scenarios": [s for s in SCENARIOS if s in args.only],
        "release_steps": args.steps,
        "hosts": list(roles.HOSTS),
        "delay_ms": scenarios_serving.DELAY_MS,
        "latency_samples": scenarios_serving.SAMPLES,
        "serve_adapters_per_host": scenarios_serving.SERVE_ADAPTERS_PER_HOST,
        "cut_serve_host": roles.SERVE[1],
        "leave_host": roles.SERVE[1],
        "leave_long_tokens": scenarios_serving.LONG_TOKENS,
        "auth": "MLflow basic auth (MinT's accounts), Prefect auth string, worker API keys",
    }
    return summarize(figures, extra, errors, settings, boot_s, scenario_s, harness.machine())


if __name__ == "__main__":
    main()
