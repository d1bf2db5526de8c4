"""A run's metrics sent in the background (mint_core/registry/run_metrics.py), against a fake
MLflow: handing a batch over never waits, even on a store that does not answer; what was handed
over reaches the run in order, once, across an outage whether or not a request cut off was
written; `close()` waits for all of it; a refusal or a registry that never answers is raised,
at the next hand-over or at `close()`, never dropped."""

import logging
import threading
import time
from collections.abc import Callable, Sequence

import pytest
from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException

from mint_core.errors import RegistryError
from mint_core.registry.run_metrics import METRICS_PER_REQUEST, Point, RunMetrics
from tasks.training import _TrainingProgress

RUN = "0123456789abcdef"


class FakeMlflow:
    """MLflow's client for one run: `log_batch` appends to the run's points in one transaction;
    `fail` (if set) decides, per request, to refuse it or to not answer, before or after
    writing it; `gate` (if set) holds each request until it is set."""

    def __init__(self) -> None:
        self.points: list[Metric] = []
        self.params: dict[str, str] = {}
        self.requests: list[int] = []
        """How many metrics each written request carried."""
        self.fail: Callable[[int], str] | None = None
        """Request number -> "", "unsent", "cut" (written, then no answer) or "refused"."""
        self.reads_fail = False
        self.gate: threading.Event | None = None
        self.tries = 0

    def log_batch(
        self, run_id: str, metrics: Sequence[Metric] = (), params: Sequence[Param] = ()
    ) -> None:
        assert run_id == RUN
        if self.gate is not None:
            self.gate.wait()
        self.tries += 1
        how = self.fail(self.tries) if self.fail else ""
        if how == "refused":
            raise MlflowException(
                "INVALID_PARAMETER_VALUE: no", error_code="INVALID_PARAMETER_VALUE"
            )
        if how == "unsent":
            raise RegistryError("MLflow at fake did not answer log_batch: Connection refused")
        for param in params:
            assert self.params.setdefault(param.key, param.value) == param.value
        self.points += metrics
        self.requests.append(len(metrics))
        if how == "cut":
            raise RegistryError("MLflow at fake did not answer log_batch: Connection reset")

    def get_metric_history(self, run_id: str, key: str) -> list[Metric]:
        if self.reads_fail:
            raise RegistryError("MLflow at fake did not answer get_metric_history for 5 s")
        return [m for m in self.points if m.key == key]

    def losses(self) -> list[tuple[int, float]]:
        return [(m.step, m.value) for m in self.points if m.key == "loss"]


def curve(steps: int) -> list[tuple[int, float]]:
    return [(step, 1.0 / step) for step in range(1, steps + 1)]


def hand_over(sender: RunMetrics, steps: int, every: int = 5) -> None:
    points = [Point(step, value) for step, value in curve(steps)]
    for start in range(0, steps, every):
        sender.log_series("loss", points[start : start + every])


def test_hand_overs_never_wait_on_a_store_that_does_not_answer() -> None:
    """A training's 100 hand-overs to a store whose first request hangs (MLflow cut off while
    the client waits it out) return at once; once it answers, every point is there, in order,
    once, in few requests (what waited was merged)."""
    mlflow = FakeMlflow()
    mlflow.gate = threading.Event()
    sender = RunMetrics(mlflow, RUN)
    start = time.monotonic()
    hand_over(sender, 500)
    handed_s = time.monotonic() - start
    assert handed_s < 0.5, f"100 hand-overs took {handed_s:.2f} s"
    assert mlflow.points == [] and sender.waiting >= 99
    mlflow.gate.set()
    sender.close()
    assert mlflow.losses() == curve(500)
    assert len(mlflow.requests) <= 3  # the first (5 points), then the 99 that waited, merged
    assert max(mlflow.requests) <= METRICS_PER_REQUEST


def test_the_training_loop_never_waits_on_the_store() -> None:
    """`_TrainingProgress.step`, the training thread's, with a store that does not answer."""
    mlflow = FakeMlflow()
    mlflow.gate = threading.Event()
    sender = RunMetrics(mlflow, RUN)
    progress = _TrainingProgress(sender, logging.getLogger(__name__))
    start = time.monotonic()
    for step, loss in curve(1000):
        progress.step(step, 1000, loss)
    took_s = time.monotonic() - start
    assert took_s < 1.0, f"1000 steps took {took_s:.2f} s with MLflow away"
    mlflow.gate.set()
    progress.close()
    assert [(m.step, m.value) for m in mlflow.points] == curve(1000)
    stamps = [m.timestamp for m in mlflow.points]
    assert stamps == sorted(stamps) and stamps[-1] - stamps[0] <= took_s * 1000 + 1


OUTAGES: dict[str, Callable[[int], str]] = {
    "requests refused, none written": lambda n: "unsent" if 2 <= n <= 4 else "",
    "written, answer lost": lambda n: "cut" if n in (2, 3) else "",
    "both in turn": lambda n: {2: "unsent", 3: "cut", 4: "unsent", 6: "cut"}.get(n, ""),
}


@pytest.mark.parametrize("fail", OUTAGES.values(), ids=OUTAGES.keys())
def test_an_outage_loses_nothing_and_repeats_nothing(fail: Callable[[int], str]) -> None:
    mlflow = FakeMlflow()
    mlflow.fail = fail
    with RunMetrics(mlflow, RUN) as sender:
        sender.log_params({"rank": "8", "alpha": "16"})
        for start in range(0, 200, 20):
            sender.log_series("loss", [Point(s, 1.0 / s) for s in range(start + 1, start + 21)])
            time.sleep(0.002)  # mostly one request per hand-over: the failures meet several
    assert mlflow.losses() == curve(200)
    assert mlflow.params == {"rank": "8", "alpha": "16"}


def test_metrics_and_params_keep_their_order_and_big_batches_are_split() -> None:
    mlflow = FakeMlflow()
    with RunMetrics(mlflow, RUN) as sender:
        sender.log_params({f"p{i:03d}": str(i) for i in range(150)})
        sender.log_series("loss", [Point(s, 1.0 / s) for s in range(1, 2501)])
        sender.log_metrics(2500, {"eval_loss": 0.5, "accuracy": 0.9})
    assert mlflow.losses() == curve(2500)
    assert [m.key for m in mlflow.points[-2:]] == ["accuracy", "eval_loss"]
    assert len(mlflow.params) == 150
    assert max(mlflow.requests) <= METRICS_PER_REQUEST


def test_close_waits_until_everything_was_sent() -> None:
    mlflow = FakeMlflow()
    mlflow.fail = lambda n: "unsent" if n <= 3 else ""  # slowed further by the check below
    sender = RunMetrics(mlflow, RUN)
    hand_over(sender, 100)
    sender.close()
    assert sender.waiting == 0
    assert mlflow.losses() == curve(100)


def test_a_refusal_is_raised_at_the_next_hand_over_then_not_again() -> None:
    mlflow = FakeMlflow()
    mlflow.fail = lambda n: "refused" if n == 2 else ""
    mlflow.gate = threading.Event()
    sender = RunMetrics(mlflow, RUN)
    sender.log_series("loss", [Point(s, 1.0 / s) for s in range(1, 6)])
    time.sleep(0.05)  # the first request taken, alone; the next two wait, merged into one
    sender.log_series("loss", [Point(s, 1.0 / s) for s in range(6, 11)])
    sender.log_series("loss", [Point(s, 1.0 / s) for s in range(11, 16)])
    mlflow.gate.set()
    deadline = time.monotonic() + 5
    with pytest.raises(RegistryError, match=r"MLflow refused 1\d metric points \(steps 6-1\d\)"):
        while time.monotonic() < deadline:
            sender.log_series("loss", [Point(16, 0.1)])
            time.sleep(0.01)
    sender.close()  # raised once: training already failed on it
    assert mlflow.losses() == curve(5)


def test_a_refusal_after_the_last_hand_over_is_raised_by_close() -> None:
    mlflow = FakeMlflow()
    mlflow.fail = lambda n: "refused"
    sender = RunMetrics(mlflow, RUN)
    sender.log_params({"rank": "8"})
    with pytest.raises(RegistryError, match="MLflow refused 0 metric points and 1 params"):
        sender.close()


def test_a_registry_that_never_answers_fails_close_with_its_error() -> None:
    """Past MINT_REGISTRY_RETRY_S the client raises at once: the sender gives up with the
    client's error (what today's synchronous call raised), which fails the release before it
    registers anything; what it could not send stays unsent, not sent twice later."""
    mlflow = FakeMlflow()
    mlflow.fail = lambda n: "unsent"
    mlflow.reads_fail = True
    sender = RunMetrics(mlflow, RUN)
    hand_over(sender, 20)
    with pytest.raises(RegistryError, match="did not answer get_metric_history for 5 s"):
        sender.close()
    with pytest.raises(RegistryError, match="did not answer"):
        sender.log_series("loss", [Point(21, 0.1)])
    assert mlflow.points == []
