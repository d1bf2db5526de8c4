"""How long this process waits out an MLflow that does not answer, and what it says meanwhile.

A release that meets a registry restart should not fail for it; nor should it wait without a
word, or without end. So a call to MLflow that could not reach the server (connection refused,
or nothing answering before the connect timeout: the request never left, so sending it again
cannot write anything twice) is tried again, with a growing pause, for at most `wait_s`
seconds per outage (`MINT_REGISTRY_RETRY_S`, set at the edges: the commands that run the
pipeline); the first failure of an outage says so in one line (the logger `LOGGER`, which the
CLI shows on the terminal), the end of one says how long it lasted. Past the bound, calls fail
at once with the cause until the server answers again. The bound is the outage's, not each
call's: a training run that logs its loss every few steps waits once, not once per step.

Kept apart from `mint_core.registry` (which imports MLflow's client) so the command line can set
the bound without importing MLflow. The default, 0, waits for nothing: a serving worker's
catalog must answer at once with what it holds rather than hold requests.
"""

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

LOGGER = "mint_core.registry_outages"
"""The logger of the outage lines: what the command line shows on the terminal."""
FIRST_PAUSE_S = 0.5
"""The pause before the first retry; each one doubles it, up to `LONGEST_PAUSE_S`."""
LONGEST_PAUSE_S = 5.0

log = logging.getLogger(LOGGER)


@dataclass
class _Outage:
    since: float
    """`time.monotonic()` of the first failure."""
    pause_s: float
    """The pause before the next try."""


class Outages:
    """The outages of the registries this process talks to, by tracking URI."""

    def __init__(self, wait_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.wait_s = wait_s
        """Seconds an outage is waited out before calls fail (0: never waited)."""
        self._clock = clock
        self._lock = threading.Lock()
        self._outages: dict[str, _Outage] = {}

    def failed(self, uri: str, cause: str) -> float | None:
        """A call to the server at `uri` did not reach it, for `cause`: how long to pause before
        trying it again, or None when the outage has lasted `wait_s` (the call should fail)."""
        now = self._clock()
        with self._lock:
            outage = self._outages.get(uri)
            if outage is None:
                outage = self._outages[uri] = _Outage(now, FIRST_PAUSE_S)
                if self.wait_s > 0:
                    log.warning(
                        "MLflow at %s (MLFLOW_TRACKING_URI) does not answer (%s); trying again "
                        "for up to %.0f s (MINT_REGISTRY_RETRY_S)",
                        uri,
                        cause,
                        self.wait_s,
                    )
            left = outage.since + self.wait_s - now
            if left <= 0:
                return None
            pause = min(outage.pause_s, left)
            outage.pause_s = min(outage.pause_s * 2, LONGEST_PAUSE_S)
            return pause

    def answered(self, uri: str) -> None:
        """A call to `uri` got an answer: any outage of it is over."""
        if uri not in self._outages:  # the usual case, read without the lock
            return
        with self._lock:
            outage = self._outages.pop(uri, None)
        if outage is not None and self.wait_s > 0:
            log.warning(
                "MLflow at %s answers again, after %.0f s", uri, self._clock() - outage.since
            )

    def waited_s(self, uri: str) -> float:
        """How long the current outage of `uri` has lasted (0 if none)."""
        with self._lock:
            outage = self._outages.get(uri)
        return 0.0 if outage is None else self._clock() - outage.since


OUTAGES = Outages()
"""This process's: every MLflow client of the registry reports to it."""


def wait_out_registry_outages(seconds: float) -> None:
    """Let calls to MLflow wait out an outage for up to `seconds` (at an edge: a command that
    runs the pipeline); 0 makes them fail at once."""
    OUTAGES.wait_s = seconds


def notice_registry_outages_quickly() -> None:
    """Make this process's MLflow client give up on an unanswering server within seconds (one
    retry, 5 s per request) unless the environment says otherwise: for the processes that
    follow the registry in the background (a worker, a gateway), which must report `degraded`
    and serve on, not wait through MLflow's default minutes of retries."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
