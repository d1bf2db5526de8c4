"""A worker leaving the fleet without failing a request (`mint up --role serve` or `mint serve`
sent SIGTERM or Ctrl-C).

    serving --leave()--> leaving --(drained, or the drain timeout)--> closing

1. `leave()`: the worker says it is leaving, in `/health` (503, `status` leaving, so a load
   balancer's probe takes it out), in `/admin/routing` (`leaving`: every gateway stops routing
   to it at its next poll) and in its heartbeat (the fleet's roster leaves it out, as placement
   does: `mint_core.planning.roster.Standing.LEAVING`).
2. It keeps listening and serving: a request sent before a gateway saw it leaving still arrives
   (through a relay or a load balancer, a closed listener would be a reset the gateway cannot
   tell from a failure), and the gateways' polls still answer, so none of them takes it for cut
   off and ends its requests.
3. Its listener closes (`Verdict.CLOSE`) once it has nothing in flight and at least
   `notice_s` have passed since it said so and since the last request arrived: a gateway's
   poll interval and a registry sync, by which every gateway has stopped sending. Past
   `timeout_s` (MINT_DRAIN_TIMEOUT_MS) it closes whatever it still has (`Verdict.TIMED_OUT`).

`DrainPlan.verdict` is the pure decision; `Drain` counts the requests and holds the state
(thread-safe: request handlers and the thread that waits share it).
"""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from mint_core.errors import TransitionError
from serving.http.wire import ROUTING_REFRESH_S

_POLL_S = 0.05


class Departure(StrEnum):
    """Where a worker is in leaving."""

    SERVING = "serving"
    """Routed to; takes requests."""
    LEAVING = "leaving"
    """Said it is leaving: not routed to any more, still listening, finishing what it has."""
    CLOSING = "closing"
    """Its listener closes: nobody sends to it any more, or the drain timed out."""


_MOVES: dict[Departure, frozenset[Departure]] = {
    Departure.SERVING: frozenset({Departure.LEAVING}),
    Departure.LEAVING: frozenset({Departure.CLOSING}),
    Departure.CLOSING: frozenset(),
}


class Verdict(StrEnum):
    """What a leaving worker does next."""

    WAIT = "wait"
    """Requests in flight, or gateways that may still send: keep listening."""
    CLOSE = "close"
    """Nothing in flight and nobody sending: close the listener."""
    TIMED_OUT = "timed_out"
    """The drain timeout passed: close, cutting what is left."""


@dataclass(frozen=True)
class DrainPlan:
    """How long a leaving worker keeps listening."""

    notice_s: float
    """Time for every gateway to see it leaving: the gateway's poll interval and a sync of
    the fleet's roster."""
    timeout_s: float
    """The longest it waits for its requests (MINT_DRAIN_TIMEOUT_MS)."""

    @classmethod
    def of(cls, sync_interval_s: float, timeout_s: float) -> "DrainPlan":
        return cls(ROUTING_REFRESH_S + sync_interval_s, timeout_s)

    def verdict(self, since_leaving: float, since_arrival: float, in_flight: int) -> Verdict:
        """What to do `since_leaving` seconds after saying so, the last request having arrived
        `since_arrival` seconds ago (inf: none did), with `in_flight` requests."""
        if since_leaving >= self.timeout_s:
            return Verdict.TIMED_OUT
        if in_flight or min(since_leaving, since_arrival) < self.notice_s:
            return Verdict.WAIT
        return Verdict.CLOSE


class Drain:
    """One worker's departure: its state and the requests it has (see the module)."""

    def __init__(self, plan: DrainPlan, clock: Callable[[], float] = time.monotonic) -> None:
        self.plan = plan
        self._clock = clock
        self._lock = threading.Lock()
        self._state = Departure.SERVING
        self._left_at: float | None = None
        self._arrived_at = float("-inf")
        self._in_flight = 0

    @property
    def state(self) -> Departure:
        return self._state

    @property
    def leaving(self) -> bool:
        """Whether it said it is leaving (then gateways must not send it new requests)."""
        return self._state is not Departure.SERVING

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def arrived(self) -> None:
        """A request arrived; `finished` when its answer has been sent."""
        with self._lock:
            self._in_flight += 1
            self._arrived_at = self._clock()

    def finished(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def leave(self) -> None:
        """Say it is leaving (from now on `/health` and `/admin/routing` say so)."""
        self._move(Departure.LEAVING)

    def verdict(self) -> Verdict:
        """What to do now, once leaving."""
        with self._lock:
            if self._left_at is None:
                return Verdict.WAIT
            now = self._clock()
            return self.plan.verdict(now - self._left_at, now - self._arrived_at, self._in_flight)

    def wait(self, sleep: Callable[[float], None] = time.sleep) -> Verdict:
        """Wait until the listener may close (CLOSE or TIMED_OUT, returned), then be closing.
        Only once leaving: TransitionError otherwise."""
        self._check(Departure.CLOSING)
        while (verdict := self.verdict()) is Verdict.WAIT:
            sleep(_POLL_S)
        self._move(Departure.CLOSING)
        return verdict

    def _check(self, to: Departure) -> None:
        if to not in _MOVES[self._state]:
            allowed = ", ".join(_MOVES[self._state]) or "none"
            raise TransitionError(
                f"a worker that is {self._state} cannot become {to} (allowed: {allowed})"
            )

    def _move(self, to: Departure) -> None:
        with self._lock:
            self._check(to)
            self._state = to
            if to is Departure.LEAVING:
                self._left_at = self._clock()
