"""The serving scenarios on the booted cluster (tests/cluster/roles.py), as drivers returning
frozen figures: the tests assert on them, bench/cluster.py records them.

    serve_cut     a serve host's link goes down under client load through the gateway; the
                  revisions it held answer from the other host; link up: it rejoins and
                  takes its share back, nothing else moves
    control_cut   ctl's link goes down: the serve hosts go on serving what they hold
                  (`degraded` in /health), no alias moves; link up: they catch up and a
                  promotion works
    latency       20 ms added between the gateway and the serve hosts (their relays): what
                  the gateway adds to a client's p50, and promote -> the client sees it
    serve_leave   a serve host's `mint up` sent SIGTERM under client load with long
                  generations in flight, through its relay and then advertising its own URL:
                  no request fails; it is started again as it was booted

The pipeline is tests/cluster/pipeline.py's, in the client host, started once per cluster by
`seeded()`, which releases the adapters every scenario uses once: random LoRAs imported to
production, placed over both serve hosts. Each scenario leaves the cluster as it found it:
every link up, every delay 0.
"""

import contextlib
import json
import signal
import statistics
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mint_core.errors import ServiceError
from mint_core.planning.placement import place
from tests.cluster import drive, roles
from tests.cluster.pipeline import Pipeline
from tests.cluster.roles import CLIENT, CONTROL, Booted

SERVE_ADAPTERS_PER_HOST = 2
LATENCY_ADAPTER = "lat-bot"
"""Two revisions: promotions alternate between them."""
RECOVERY_TIMEOUT_S = 90.0
SETTLE_S = 4.0
HEALTH_TIMEOUT_S = 60.0
SAMPLES = 30
"""Requests per p50, one after another."""
DELAY_MS = 20
OK_STATUSES = frozenset({502, 503})
"""The clear answers a request may get while its worker is cut off."""


# --- Seeding ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Seeded:
    """The adapters every serving scenario uses."""

    pipeline: Pipeline
    by_host: dict[str, list[str]]
    """serve role -> adapters whose production revision is placed on its worker."""
    latency_revisions: tuple[str, str]
    """LATENCY_ADAPTER's two revisions (the second is production once seeded)."""


_SEEDED: dict[str, Seeded] = {}


def seeded(booted: Booted) -> Seeded:
    """Seed the cluster once: SERVE_ADAPTERS_PER_HOST adapters per serve host (names chosen
    so that placement puts their first revision there) and LATENCY_ADAPTER's two revisions,
    each imported and released to production."""
    tag = booted.cluster.tag
    if tag in _SEEDED:
        return _SEEDED[tag]
    names = list(booted.worker_urls.values())
    by_host: dict[str, list[str]] = {role: [] for role in booted.worker_urls}
    for i in range(1000):
        adapter = f"sv-{i}"
        (url,) = place(f"{adapter}:r1", names)
        role = next(r for r, u in booted.worker_urls.items() if u == url)
        if len(by_host[role]) < SERVE_ADAPTERS_PER_HOST:
            by_host[role].append(adapter)
        if all(len(a) == SERVE_ADAPTERS_PER_HOST for a in by_host.values()):
            break
    pipeline = Pipeline(booted)
    for seed, adapter in enumerate(a for adapters in by_host.values() for a in adapters):
        pipeline.ask(op="import", adapter=adapter, seed=seed)
    first = pipeline.ask(op="import", adapter=LATENCY_ADAPTER, seed=101)["result"]
    second = pipeline.ask(op="import", adapter=LATENCY_ADAPTER, seed=102)["result"]
    _SEEDED[tag] = Seeded(pipeline, by_host, (first, second))
    return _SEEDED[tag]


# --- Small helpers --------------------------------------------------------------------------


def get_json(url: str, timeout_s: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return json.load(response)


def generate(booted: Booted, adapter: str) -> tuple[int, dict[str, str]]:
    """One request for `adapter` through the gateway: its status and headers (lower case)."""
    body = {"inputs": "hello=", "parameters": {"adapter_id": adapter, "max_new_tokens": 4}}
    request = urllib.request.Request(booted.gateway_url + "/generate", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=15) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}


def answering_workers(booted: Booted, adapters: list[str]) -> dict[str, str]:
    """adapter -> the worker URL that answers it through the gateway now (X-Mint-Worker)."""
    found = {}
    for adapter in adapters:
        status, headers = generate(booted, adapter)
        if status != 200:
            raise ServiceError(f"{adapter} answered {status} through the gateway: {headers}")
        found[adapter] = headers["x-mint-worker"]
    return found


def gateway_up(booted: Booted) -> set[str]:
    try:
        health = get_json(booted.gateway_url + "/health")
    except (OSError, ValueError):
        return set()
    return {w["url"] for w in health["workers"] if w["up"]}


def _wait(what: str, done: Callable[[], object], timeout_s: float, step_s: float = 0.2) -> float:
    """Seconds until `done()` is true; ServiceError naming `what` otherwise."""
    start = time.monotonic()
    while not done():
        if time.monotonic() - start > timeout_s:
            raise ServiceError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(step_s)
    return time.monotonic() - start


# --- A serve host cut off -------------------------------------------------------------------


@dataclass(frozen=True)
class ServeCutFigures:
    cut_host: str
    recovery_s: float
    """From the cut until every production revision the cut host held answered 200 from
    the other serve host."""
    failed_requests: int
    requests: int
    failed_status: list[object]
    """The statuses of the failed requests (null: no answer at all)."""
    retried: int
    """Requests answered 503 with Retry-After first (the other host was taking the revision
    in), then 200 once asked again: a client honouring Retry-After loses none of them."""
    in_flight_at_cut: int
    """Requests for the cut host's revisions in flight between the cut and the gateway
    marking it down (it cannot know sooner): the ones that may fail."""
    down_s: float
    """From the cut until the gateway's /health listed the host down."""
    rejoin_s: float
    """From link up until the gateway listed the host up and each of its revisions answered
    from it again."""
    moved_after_rejoin: int
    """Revisions whose last answer, SETTLE_S after the rejoined host answered each of its
    own again, came from another worker than before the cut (answers elsewhere meanwhile:
    notes)."""
    notes: dict[str, str] = field(default_factory=dict)

    def as_json(self) -> dict[str, object]:
        return {"serve_cut": asdict(self)}


def serve_cut(booted: Booted, folder: Path, cut_host: str = roles.SERVE[1]) -> ServeCutFigures:
    """Cut `cut_host` off under load (a client lane per seeded adapter, through the
    gateway), wait until its revisions answer from the other host, then rejoin it."""
    seeds = seeded(booted)
    adapters = [a for hosts in seeds.by_host.values() for a in hosts]
    held = seeds.by_host[cut_host]
    victim = booted.worker_urls[cut_host]
    (other,) = [u for r, u in booted.worker_urls.items() if r != cut_host]
    before = answering_workers(booted, adapters)
    lanes = {a: RetryingClient(booted, a, folder) for a in adapters}
    clients = [lanes[a] for a in held]
    try:
        time.sleep(2.0)  # every lane under way before the cut
        cut_at = time.time()
        booted.cluster.cut(cut_host)
        try:
            down_s = _wait("the gateway lists the cut host down",
                           lambda: victim not in gateway_up(booted), HEALTH_TIMEOUT_S)  # fmt: skip
            down_at = cut_at + down_s

            def recovered() -> bool:
                return all(_answered_by(c, other, cut_at) for c in clients)

            _wait("the cut host's revisions answer from the other", recovered, RECOVERY_TIMEOUT_S)
            recovery_s = max(_answered_by(c, other, cut_at)["t_end"] - cut_at  # type: ignore[index]
                             for c in clients)  # fmt: skip
        finally:
            booted.cluster.rejoin(cut_host)
        rejoined_at = time.time()
        _wait("the gateway lists the rejoined host up",
              lambda: victim in gateway_up(booted), HEALTH_TIMEOUT_S)  # fmt: skip
        _wait("the rejoined host's revisions answer from it again",
              lambda: all(_answered_by(c, victim, rejoined_at) for c in clients),
              RECOVERY_TIMEOUT_S)  # fmt: skip
        rejoin_s = max(_answered_by(c, victim, rejoined_at)["t_end"] - rejoined_at  # type: ignore[index]
                       for c in clients)  # fmt: skip
        settled_at, flaps = time.time(), []
        while time.time() < settled_at + SETTLE_S:  # the share back for good, not for once
            flaps.append(victim in gateway_up(booted))
            time.sleep(0.2)
    finally:
        for client in lanes.values():
            client.stop()
    settled = {a: [x["headers"].get("X-Mint-Worker") for x in lanes[a].answers()
                   if x["t_start"] >= settled_at and x["status"] == 200]
               for a in adapters}  # fmt: skip
    answers = [a | {"adapter": name} for name, c in lanes.items() for a in c.answers()]
    failed = [a for a in answers if a["status"] != 200]
    in_flight = [a for c in clients for a in c.answers()
                 if a["t_start"] < down_at and a["t_end"] > cut_at]  # fmt: skip
    return ServeCutFigures(
        cut_host=cut_host,
        recovery_s=round(recovery_s, 3),
        failed_requests=len(failed),
        requests=len(answers),
        failed_status=sorted({a["status"] for a in failed}, key=str),
        retried=sum(1 for a in answers if a["status"] == 200 and a.get("attempts", 1) > 1),
        in_flight_at_cut=len(in_flight),
        down_s=round(down_s, 3),
        rejoin_s=round(rejoin_s, 3),
        moved_after_rejoin=sum(1 for a in adapters if settled[a][-1:] != [before[a]]),
        notes={
            "held": ",".join(held),
            "answered_elsewhere_while_settling": str(
                sum(1 for a in adapters for w in settled[a] if w != before[a])
            ),
            "gateway_saw_it_up_after_rejoin": f"{sum(flaps)}/{len(flaps)}",
            "failed": "; ".join(_failure_note(a, cut_at, down_at, rejoined_at) for a in failed),
        },
    )


def _failure_note(answer: dict, cut_at: float, down_at: float, rejoined_at: float) -> str:
    """A failed request's adapter, status, what it said and when it was sent, against the
    cut (+s from it), the gateway marking the host down, and the link's return."""
    sent = answer["t_start"]
    phase = ("before the cut" if sent < cut_at else "before down" if sent < down_at
             else "while down" if sent < rejoined_at else "after the rejoin")  # fmt: skip
    said = answer.get("said") or answer["error"]
    return (f"{answer['adapter']} {answer['status']} ({said}) sent {phase}, "
            f"{sent - cut_at:+.2f} s, took {answer['t_end'] - sent:.2f} s")  # fmt: skip


class RetryingClient(drive.Client):
    """drive.Client's lane (every 0.2 s) honouring a 503's Retry-After up to `retries` times,
    as OpenAI's clients do."""

    def __init__(self, booted: Booted, adapter: str, folder: Path, retries: int = 20) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.stop_file, self.out = folder / f"{adapter}.stop", folder / f"{adapter}.jsonl"
        body = {"inputs": "hello=", "parameters": {"adapter_id": adapter, "max_new_tokens": 4}}
        argv = [sys.executable, "-m", "tests.cluster.load", "--url",
                f"{booted.gateway_url}/generate", "--json", json.dumps(body), "--interval", "0.2",
                "--timeout", "10", "--retries", str(retries), "--stop-file", str(self.stop_file),
                "--out", str(self.out)]  # fmt: skip
        self.process = booted.cluster.run(CLIENT, f"client-{adapter}", argv)


def _answered_by(client: "drive.Client", worker: str, since: float) -> dict | None:
    """The client's first 200 answer from `worker` sent after `since`, if any."""
    return next(
        (a for a in client.answers() if a["status"] == 200 and a["t_start"] >= since
         and a["headers"].get("X-Mint-Worker") == worker),
        None,
    )  # fmt: skip


# --- The control host cut off ---------------------------------------------------------------


@dataclass(frozen=True)
class ControlCutFigures:
    served_while_cut: bool
    """Every request the client sent while ctl was cut off was answered 200."""
    requests_while_cut: int
    degraded_seen: bool
    """Every serve host's /health said `degraded` while ctl was cut off."""
    gateway_degraded_seen: bool
    """The gateway's /health said `degraded` while ctl was cut off (not waited for)."""
    alias_moves_while_cut: int
    """Production aliases of the seeded adapters that differ after the cut from before."""
    catch_up_s: float
    """From link up until every serve host and the gateway said `ok` again."""
    promote_ok: bool
    """A promotion after the rejoin completed and the client got the promoted revision."""
    promote_s: float
    cut_s: float
    notes: dict[str, str] = field(default_factory=dict)

    def as_json(self) -> dict[str, object]:
        return {"control_cut": asdict(self)}


def control_cut(booted: Booted, folder: Path, hold_s: float = 3.0) -> ControlCutFigures:
    """Cut ctl off under load (one client lane per serve host's adapter) until every serve
    host said `degraded`, `hold_s` more; then rejoin it, wait for `ok`
    everywhere and promote LATENCY_ADAPTER's other revision."""
    seeds = seeded(booted)
    adapters = [hosts[0] for hosts in seeds.by_host.values()]
    watched = [*seeds.by_host.values()]
    mlflow = drive.Mlflow.of(booted)
    every = [a for hosts in watched for a in hosts] + [LATENCY_ADAPTER]
    aliases_before = {a: _production(mlflow, a) for a in every}
    lanes = [drive.Client(booted, a, folder, interval_s=0.2) for a in adapters]
    said: dict[str, set[str]] = {}
    workers = [url + "/health" for url in booted.direct_urls.values()]
    try:
        time.sleep(1.0)
        cut_at = time.time()
        booted.cluster.cut(CONTROL)
        try:
            deadline = time.monotonic() + HEALTH_TIMEOUT_S
            while time.monotonic() < deadline and not all(
                "degraded" in said.get(u, set()) for u in workers
            ):
                _note_health(booted, said)
                time.sleep(0.3)
            _note_health(booted, said, hold_s)
        finally:
            booted.cluster.rejoin(CONTROL)
        rejoined_at = time.time()
        catch_up_s = _wait("every serve host and the gateway say ok",
                           lambda: _all_ok(booted), HEALTH_TIMEOUT_S, 0.1)  # fmt: skip
    finally:
        for lane in lanes:
            lane.stop()
    aliases_after = {a: _production(mlflow, a) for a in every}
    while_cut = [a for lane in lanes for a in lane.answers()
                 if a["t_start"] >= cut_at and a["t_end"] <= rejoined_at]  # fmt: skip
    current = aliases_after[LATENCY_ADAPTER]
    target = next(r for r in seeds.latency_revisions if r != current)
    promote_s, promote_ok = _promote_and_see(booted, seeds.pipeline, target)
    return ControlCutFigures(
        served_while_cut=bool(while_cut) and all(a["status"] == 200 for a in while_cut),
        requests_while_cut=len(while_cut),
        degraded_seen=all("degraded" in said.get(u, set()) for u in workers),
        gateway_degraded_seen="degraded" in said.get(booted.gateway_url + "/health", set()),
        alias_moves_while_cut=sum(1 for a in every if aliases_before[a] != aliases_after[a]),
        catch_up_s=round(catch_up_s, 3),
        promote_ok=promote_ok,
        promote_s=round(promote_s, 3),
        cut_s=round(rejoined_at - cut_at, 3),
        notes={
            "promoted": target,
            "statuses_while_cut": ",".join(sorted({str(a["status"]) for a in while_cut})),
        },
    )


def _production(mlflow: drive.Mlflow, adapter: str) -> str:
    """The revision `adapter@production` names (`adapter:rN`), "" if none."""
    model = mlflow.get("registered-models/get", name=adapter)["registered_model"]
    found = [a["version"] for a in model.get("aliases", []) if a["alias"] == "production"]
    return f"{adapter}:r{found[0]}" if found else ""


def _health_urls(booted: Booted) -> list[str]:
    return [u + "/health" for u in booted.direct_urls.values()] + [booted.gateway_url + "/health"]


def _note_health(booted: Booted, said: dict[str, set[str]], for_s: float = 0.0) -> None:
    """Record what each serve host's and the gateway's /health says now (and for `for_s`)."""
    end = time.monotonic() + for_s
    while True:
        for url in _health_urls(booted):
            with contextlib.suppress(OSError, ValueError):
                said.setdefault(url, set()).add(str(get_json(url, 2.0)["status"]))
        if time.monotonic() >= end:
            return
        time.sleep(0.3)


def _all_ok(booted: Booted) -> bool:
    said: dict[str, set[str]] = {}
    _note_health(booted, said)
    return all(said.get(u) == {"ok"} for u in _health_urls(booted))


def _promote_and_see(booted: Booted, pipeline: Pipeline, target: str) -> tuple[float, bool]:
    """Promote `target` (`adapter:rN`) through the pipeline; (seconds from the promotion's
    start until the gateway answers with it, whether it did)."""
    adapter, _, number = target.rpartition(":r")
    answer = pipeline.ask(op="promote", adapter=adapter, revision=int(number))

    def seen() -> bool:
        return generate(booted, adapter)[1].get("x-mint-revision") == target

    try:
        _wait(f"the gateway answers {adapter} with {target}", seen, HEALTH_TIMEOUT_S)
    except ServiceError:
        return time.time() - answer["t_start"], False
    return time.time() - answer["t_start"], True


# --- Latency between hosts ------------------------------------------------------------------


@dataclass(frozen=True)
class LatencyFigures:
    added_p50_ms_no_delay: float
    """The client's p50 through the gateway minus its p50 straight to the worker."""
    added_p50_ms_20ms: float
    activation_s_no_delay: float
    """From the promotion's start until the client's first answer by the promoted revision."""
    activation_s_20ms: float
    relay_overhead_ms: float
    """The client's p50 through the relay (delay 0) minus its p50 straight to the worker."""
    delay_applies_to: str
    p50_ms: dict[str, float] = field(default_factory=dict)
    """Each measured path's p50 (`gateway@0`, `direct@0`, `relay@0`, `gateway@20`, ...)."""
    samples: int = SAMPLES

    def as_json(self) -> dict[str, object]:
        return {"latency": asdict(self)}


DELAY_APPLIES_TO = (
    "request bytes sent to a serve worker's advertised URL (its relay, :8001): gateway -> "
    "worker, pipeline -> worker (admit, prewarm, activate) and worker -> worker; not client "
    "-> gateway, not anything to or from ctl"
)


def latency(booted: Booted, folder: Path, delay_ms: int = DELAY_MS) -> LatencyFigures:
    """p50s and an activation with no delay, then with `delay_ms` on both serve hosts'
    relays; the delay is 0 again at the end, whatever happens."""
    seeds = seeded(booted)
    p50: dict[str, float] = {}
    activation: dict[int, float] = {}
    try:
        for delay in (0, delay_ms):
            for path in booted.delay_files.values():
                path.write_text(str(delay))
            time.sleep(0.2)  # the relays read the file again on its next chunk
            worker = answering_workers(booted, [LATENCY_ADAPTER])[LATENCY_ADAPTER]
            role = next(r for r, u in booted.worker_urls.items() if u == worker)
            key = booted.host_envs["serve"]["MINT_WORKER_API_KEY"]
            p50[f"gateway@{delay}"] = _p50_ms(booted, booted.gateway_url)
            p50[f"direct@{delay}"] = _p50_ms(booted, booted.direct_urls[role], key)
            if delay == 0:
                p50["relay@0"] = _p50_ms(booted, booted.worker_urls[role], key)
            activation[delay] = _activation_s(booted, seeds, folder / f"delay-{delay}")
    finally:
        for path in booted.delay_files.values():
            path.write_text("0")
    return LatencyFigures(
        added_p50_ms_no_delay=round(p50["gateway@0"] - p50["direct@0"], 2),
        added_p50_ms_20ms=round(p50[f"gateway@{delay_ms}"] - p50[f"direct@{delay_ms}"], 2),
        activation_s_no_delay=round(activation[0], 3),
        activation_s_20ms=round(activation[delay_ms], 3),
        relay_overhead_ms=round(p50["relay@0"] - p50["direct@0"], 2),
        delay_applies_to=DELAY_APPLIES_TO,
        p50_ms={k: round(v, 2) for k, v in p50.items()},
    )


def _p50_ms(booted: Booted, url: str, key: str = "") -> float:
    """The client host's p50 over SAMPLES requests for LATENCY_ADAPTER to `url`, one after
    another on one connection (the first, which opens it, left out)."""
    body = {"inputs": "hello=", "parameters": {"adapter_id": LATENCY_ADAPTER, "max_new_tokens": 4}}
    argv = [sys.executable, "-m", "tests.cluster.load", "--url", f"{url}/generate", "--json",
            json.dumps(body), "--requests", str(SAMPLES + 1), "--timeout", "15"]  # fmt: skip
    if key:
        argv += ["--header", f"Authorization: Bearer {key}"]
    done = booted.cluster.call(CLIENT, argv, timeout_s=120.0)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    times = [(a["t_end"] - a["t_start"]) * 1000 for a in lines[1:] if a["status"] == 200]
    if len(times) < SAMPLES // 2:
        raise ServiceError(f"too few answers from {url}: {lines[:3]} {done.stderr[-1500:]}")
    return statistics.median(times)


def _activation_s(booted: Booted, seeds: Seeded, folder: Path) -> float:
    """Promote LATENCY_ADAPTER's other revision with a client asking for it through the
    gateway: seconds from the promotion's start to the client's first answer by it."""
    mlflow = drive.Mlflow.of(booted)
    current = _production(mlflow, LATENCY_ADAPTER)
    target = next(r for r in seeds.latency_revisions if r != current)
    lane = drive.Client(booted, LATENCY_ADAPTER, folder, interval_s=0.1)
    try:
        _wait("the client's first answer", lambda: bool(lane.answers()), HEALTH_TIMEOUT_S)
        answer = seeds.pipeline.ask(op="promote", adapter=LATENCY_ADAPTER,
                                    revision=int(target.rpartition(":r")[2]))  # fmt: skip
        _wait(f"the client sees {target}", lambda: lane.first(target) is not None,
              HEALTH_TIMEOUT_S)  # fmt: skip
        seen = lane.first(target)
    finally:
        lane.stop()
    return seen["t_end"] - answer["t_start"]  # type: ignore[index]


# --- A serve host leaving -------------------------------------------------------------------

LONG_TOKENS = 110
"""A long generation: seconds on these cores, so that some are in flight when the host leaves."""
LONG_LANES = 4
LEAVE_TIMEOUT_S = 120.0
"""How long a leaving host's `mint up` may take to exit (its drain is bounded well below)."""
LEAVE_TRIES = 3
"""Leaves per way of reaching the host, until one has a long generation in flight on it. The
gateway sends each long generation to the less loaded worker, so the leaving host's own short
requests can push all of them to the other one: a clean run once sent SIGTERM with none of the
4 on it, and such a leave shows nothing about requests in flight."""


@dataclass(frozen=True)
class LeavePhase:
    """One leave: a serve host's `mint up` sent SIGTERM under load."""

    via: str
    """`relay`: the gateway reached the worker through its relay (a load balancer's place);
    `direct`: the worker advertised its own URL."""
    failed_requests: int
    requests: int
    in_flight_at_leave: int
    """Long generations sent to the leaving worker before the SIGTERM and not answered by then."""
    in_flight_completed: int
    """Of those, the ones answered 200."""
    exit_s: float
    """From the SIGTERM until its `mint up` exited (its drain included)."""
    failed: str = ""
    """Each failed request: status, what it said, when it was sent against the SIGTERM."""


@dataclass(frozen=True)
class ServeLeaveFigures:
    leave_host: str
    failed_requests: int
    """Over every leave."""
    requests: int
    in_flight_at_leave: int
    in_flight_completed: int
    phases: list[LeavePhase]
    """Every leave, in order: the last of each way had a long generation in flight."""

    def as_json(self) -> dict[str, object]:
        return {"leave": asdict(self)}


class LongLanes(drive.Client):
    """LONG_LANES lanes of long base-model generations through the gateway, one after another
    (honouring a 503's Retry-After), spread over the workers by their load."""

    def __init__(self, booted: Booted, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.stop_file, self.out = folder / "long.stop", folder / "long.jsonl"
        parameters = {"max_new_tokens": LONG_TOKENS, "do_sample": True}
        body = {"inputs": "hello=", "parameters": parameters}
        argv = [sys.executable, "-m", "tests.cluster.load", "--url",
                f"{booted.gateway_url}/generate", "--json", json.dumps(body), "--concurrency",
                str(LONG_LANES), "--timeout", "120", "--retries", "20", "--stop-file",
                str(self.stop_file), "--out", str(self.out)]  # fmt: skip
        self.process = booted.cluster.run(CLIENT, "client-long", argv)

    def stop(self) -> None:
        self.stop_file.touch()
        try:
            self.process.process.wait(timeout=LEAVE_TIMEOUT_S)
        finally:
            self.process.stop()


def serve_leave(booted: Booted, folder: Path, host: str = roles.SERVE[1]) -> ServeLeaveFigures:
    """SIGTERM `host`'s `mint up` under load (a short-request lane per seeded adapter and
    LongLanes), through its relay; start it again advertising its own URL and do it again (each
    up to LEAVE_TRIES times, until a long generation was in flight on it); then start it as it
    was booted (its relay's URL) and wait until it answers its own revisions."""
    seeds = seeded(booted)
    adapters = [a for hosts in seeds.by_host.values() for a in hosts]
    before = answering_workers(booted, adapters)
    relayed, direct = booted.worker_urls[host], booted.direct_urls[host]
    phases: list[LeavePhase] = []
    try:
        for via, url in (("relay", relayed), ("direct", direct)):
            for attempt in range(LEAVE_TRIES):
                if phases:  # it left in the last one
                    roles.restart_serve(booted, host, url)
                phase = _leave_once(booted, folder / f"{via}-{attempt}", host, url, via, adapters)
                phases.append(phase)
                if phase.in_flight_at_leave:
                    break
    finally:
        booted.services[host].stop(grace_s=LEAVE_TIMEOUT_S)  # if a phase failed before its leave
        roles.restart_serve(booted, host, relayed)
    _wait("the restarted host's revisions answer from it again",
          lambda: _answered_as(booted, before), RECOVERY_TIMEOUT_S, 1.0)  # fmt: skip
    return ServeLeaveFigures(
        leave_host=host,
        failed_requests=sum(p.failed_requests for p in phases),
        requests=sum(p.requests for p in phases),
        in_flight_at_leave=sum(p.in_flight_at_leave for p in phases),
        in_flight_completed=sum(p.in_flight_completed for p in phases),
        phases=phases,
    )


def _answered_as(booted: Booted, before: dict[str, str]) -> bool:
    """Whether each adapter of `before` answers from the worker it names (one not ready
    yet, answering 503, does not)."""
    try:
        return answering_workers(booted, list(before)) == before
    except ServiceError:
        return False


def _leave_once(
    booted: Booted, folder: Path, host: str, victim: str, via: str, adapters: list[str]
) -> LeavePhase:
    """One leave of `host` (the gateway knows it as `victim`) under load."""
    lanes = [RetryingClient(booted, a, folder) for a in adapters]
    long = LongLanes(booted, folder)
    try:
        _wait("a long generation in flight on the leaving worker",
              lambda: _in_flight(booted, victim) >= 2, HEALTH_TIMEOUT_S, 0.05)  # fmt: skip
        term_at = time.time()
        booted.services[host].process.send_signal(signal.SIGTERM)
        booted.services[host].process.wait(timeout=LEAVE_TIMEOUT_S)
        exit_s = time.time() - term_at
        booted.services[host].stop()  # whatever its group left
        time.sleep(1.0)  # requests sent after it left, too
    finally:
        for lane in [*lanes, long]:
            lane.stop()
    answers = [a for lane in lanes for a in lane.answers()] + long.answers()
    failed = [a for a in answers if a["status"] != 200]
    in_flight = [a for a in long.answers() if a["t_start"] < term_at < a["t_end"]
                 and a["headers"].get("X-Mint-Worker", victim) == victim]  # fmt: skip
    notes = [f"{a['status']} ({a.get('said') or a['error']}) sent {a['t_start'] - term_at:+.2f} s"
             for a in failed]  # fmt: skip
    phase = LeavePhase(
        via=via,
        failed_requests=len(failed),
        requests=len(answers),
        in_flight_at_leave=len(in_flight),
        in_flight_completed=sum(1 for a in in_flight if a["status"] == 200),
        exit_s=round(exit_s, 3),
        failed="; ".join(notes),
    )
    print(json.dumps({"leave_phase": asdict(phase)}), flush=True)  # before the restart's wait
    return phase


def _in_flight(booted: Booted, worker: str) -> int:
    """The gateway's requests in flight on `worker` now, as its /health says."""
    try:
        health = get_json(booted.gateway_url + "/health")
    except (OSError, ValueError):
        return 0
    return sum(w.get("in_flight", 0) for w in health["workers"] if w["url"] == worker)
