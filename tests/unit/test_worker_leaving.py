"""A worker leaving without failing a request (`serving.worker.leaving`): the drain's pure
decision, its states, the requests it counts, what `/health` and `/admin/routing` say, and the
server that runs the drain before it stops listening (`serving.http.server.StoppingServer`)."""

import signal
import threading
from dataclasses import dataclass

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from mint_core.config import MintConfig
from mint_core.errors import ConfigurationError, TransitionError
from serving.http.app import Arrivals
from serving.http.server import StoppingServer
from serving.http.wire import ROUTING_REFRESH_S
from serving.worker.leaving import Departure, Drain, DrainPlan, Verdict
from tests.helpers import wait_until

PLAN = DrainPlan(notice_s=1.5, timeout_s=30.0)
NEVER = float("inf")


@dataclass(frozen=True)
class Case:
    since_leaving: float
    since_arrival: float
    in_flight: int
    verdict: Verdict


CASES = {
    "just said so: gateways may not have read it yet": Case(0.1, NEVER, 0, Verdict.WAIT),
    "notice given, nothing in flight, nobody sending": Case(1.5, NEVER, 0, Verdict.CLOSE),
    "notice given, a request in flight": Case(5.0, 4.0, 1, Verdict.WAIT),
    "notice given, a request arrived just now": Case(5.0, 0.2, 0, Verdict.WAIT),
    "notice given, the last arrival a notice ago": Case(5.0, 1.5, 0, Verdict.CLOSE),
    "the drain timeout passed, requests still in flight": Case(30.0, 0.1, 3, Verdict.TIMED_OUT),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_the_drain_plan(case: Case) -> None:
    verdict = PLAN.verdict(case.since_leaving, case.since_arrival, case.in_flight)
    assert verdict is case.verdict


def test_the_notice_is_a_gateway_poll_and_a_roster_sync() -> None:
    plan = DrainPlan.of(MintConfig.sync_interval_s, MintConfig.drain_timeout_s)
    assert plan.notice_s == ROUTING_REFRESH_S + MintConfig.sync_interval_s
    assert plan.timeout_s == 30.0
    assert DrainPlan(1.5, 0.0).verdict(0.0, NEVER, 2) is Verdict.TIMED_OUT  # 0: at once
    with pytest.raises(ConfigurationError, match="drain_timeout_s=-1"):
        MintConfig(drain_timeout_s=-1.0)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_drain_waits_for_its_requests_and_the_notice_then_closes() -> None:
    clock = Clock()
    drain = Drain(PLAN, clock)
    assert drain.state is Departure.SERVING and not drain.leaving
    drain.arrived()
    drain.arrived()
    drain.leave()
    assert drain.leaving and drain.in_flight == 2
    finished_at: list[float] = []

    def sleep(seconds: float) -> None:
        clock.sleep(seconds)
        if clock.now >= 103.0 and drain.in_flight:  # both requests end 3 s after leaving
            drain.finished()
            drain.finished()
            finished_at.append(clock.now)

    assert drain.wait(sleep) is Verdict.CLOSE
    assert drain.state is Departure.CLOSING
    assert finished_at and clock.now == pytest.approx(finished_at[0], abs=0.06)


def test_a_drain_that_times_out_says_so() -> None:
    clock = Clock()
    drain = Drain(DrainPlan(1.5, 4.0), clock)
    drain.arrived()  # never finishes
    drain.leave()
    assert drain.wait(clock.sleep) is Verdict.TIMED_OUT
    assert clock.now == pytest.approx(104.0, abs=0.06) and drain.in_flight == 1


def test_leaving_moves_one_way() -> None:
    drain = Drain(PLAN)
    with pytest.raises(TransitionError, match="serving cannot become closing"):
        drain.wait()  # not leaving: it would wait forever, so it is refused
    drain.leave()
    with pytest.raises(TransitionError, match="leaving cannot become leaving"):
        drain.leave()


def test_the_drain_counts_posts_until_answered_not_the_probes() -> None:
    drain = Drain(PLAN)
    seen: list[int] = []

    async def generate(_: Request) -> PlainTextResponse:
        seen.append(drain.in_flight)
        return PlainTextResponse("hi")

    async def health(_: Request) -> PlainTextResponse:
        seen.append(drain.in_flight)
        return PlainTextResponse("ok")

    app = Starlette(
        routes=[Route("/generate", generate, methods=["POST"]), Route("/health", health)]
    )
    with TestClient(Arrivals(app, drain)) as http:
        assert http.post("/generate").status_code == 200
        assert http.get("/health").status_code == 200
    assert seen == [1, 0] and drain.in_flight == 0


def test_the_server_runs_its_drain_before_it_stops_listening_and_a_second_signal_cuts_it() -> None:
    release = threading.Event()
    server = StoppingServer(uvicorn.Config(Starlette()), before_stop=release.wait)
    server.handle_exit(signal.SIGTERM, None)
    assert not server.should_exit  # draining: still listening
    release.set()
    wait_until(lambda: server.should_exit)

    stuck = threading.Event()
    held = StoppingServer(uvicorn.Config(Starlette()), before_stop=stuck.wait)
    held.handle_exit(signal.SIGTERM, None)
    held.handle_exit(signal.SIGTERM, None)  # told again: stop now
    assert held.should_exit
    stuck.set()
    plain = StoppingServer(uvicorn.Config(Starlette()), before_stop=None)
    plain.handle_exit(signal.SIGTERM, None)  # the gateway's, the trainer's: at once
    assert plain.should_exit
