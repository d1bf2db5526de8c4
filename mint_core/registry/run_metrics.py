"""What a run logs while it trains (its params once the base is loaded, each step's metrics),
sent to MLflow by a thread of its own, so that training never waits on the registry.

Training hands each batch to `RunMetrics` and goes on: the batch joins an ordered queue that
one sender thread empties, oldest first, merging what waited into as few requests as MLflow
takes. While MLflow does not answer, the batch at the head stays there (the client waits the
outage out, `mint_core.registry_outages`) and the later ones queue behind it; nothing is dropped
or reordered. Each point is stamped when it was handed over (when the step was taken), not when
it was sent, so a retry sends exactly the same points.

A request cut off in flight may have been written (the client does not send it again): before
sending it again the sender reads back what the run holds and sends only the points missing,
since MLflow keeps a point logged twice twice.

`close()` (at the end of training, before registration) waits until everything was sent. A
failure the client gave up on (the outage outlasted MINT_REGISTRY_RETRY_S, or MLflow refused the
batch) stops the sender: the next hand-over raises it, so the training fails as it did when it
logged in its own thread; `close()` raises it if no hand-over has.
"""

import logging
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException

from mint_core.errors import RegistryError

log = logging.getLogger(__name__)

METRICS_PER_REQUEST = 1000
"""MLflow's most metrics in one `log_batch`."""
PARAMS_PER_REQUEST = 100
"""MLflow's most params in one `log_batch`."""
RESENDS = 3
"""How many times a batch cut off in flight is checked against the run and sent again before
the sender gives up with the last error (each try already waits out an outage)."""


def now_ms() -> int:
    return int(datetime.now(UTC).timestamp() * 1000)


@dataclass(frozen=True)
class Point:
    """A metric's value at a step, stamped when it was measured."""

    step: int
    value: float
    at_ms: int = field(default_factory=now_ms)
    """Milliseconds since the epoch: the run's chart puts the point there."""


class BatchStore(Protocol):
    """What the sender needs of MLflow's client (`MlflowStore.client`)."""

    def log_batch(
        self, run_id: str, metrics: Sequence[Metric] = (), params: Sequence[Param] = ()
    ) -> object: ...

    def get_metric_history(self, run_id: str, key: str) -> list[Metric]: ...


@dataclass(frozen=True)
class _Batch:
    metrics: tuple[Metric, ...] = ()
    params: tuple[Param, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.metrics or self.params)

    def describe(self) -> str:
        steps = sorted({m.step for m in self.metrics})
        of = f"{len(self.metrics)} metric points" + (
            f" (steps {steps[0]}-{steps[-1]})" if steps else ""
        )
        return f"{of} and {len(self.params)} params"


def _key(metric: Metric) -> tuple[str, int, int]:
    """A point's identity: not its value, which may be NaN (never equal to itself)."""
    return metric.key, metric.step, metric.timestamp


class RunMetrics:
    """The params and metrics of run `run_id`, sent in the background in the order given
    (module docstring). Hand-overs never wait on MLflow; `close()` waits for all of them."""

    def __init__(self, store: BatchStore, run_id: str) -> None:
        self.run_id = run_id
        self._store = store
        self._queue: deque[_Batch] = deque()
        self._changed = threading.Condition()
        self._closing = False
        self._error: Exception | None = None
        self._error_raised = False
        self._thread = threading.Thread(
            target=self._send_all, name=f"mint-run-metrics-{run_id[:8]}", daemon=True
        )
        self._thread.start()

    def __enter__(self) -> "RunMetrics":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- Hand-overs (the training thread's) -------------------------------------------------

    def log_params(self, params: Mapping[str, str]) -> None:
        """Every param in `params` (a param, once logged, never changes)."""
        ordered = [Param(name, value) for name, value in sorted(params.items())]
        for start in range(0, len(ordered), PARAMS_PER_REQUEST):
            self._put(_Batch(params=tuple(ordered[start : start + PARAMS_PER_REQUEST])))

    def log_series(self, name: str, points: Sequence[Point]) -> None:
        """Metric `name` at each point (a loss curve's last few steps)."""
        self._put_metrics([Metric(name, p.value, p.at_ms, p.step) for p in points])

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """Every metric in `metrics` at `step`, stamped now."""
        at_ms = now_ms()
        self._put_metrics(
            [Metric(name, value, at_ms, step) for name, value in sorted(metrics.items())]
        )

    def close(self) -> None:
        """Return once everything handed over was sent; raise what stopped the sender, unless
        a hand-over raised it already. Waits at most as long as the client waits on MLflow
        (MINT_REGISTRY_RETRY_S per outage, its request timeout per request)."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._thread.join()
        if self._error is not None and not self._error_raised:
            self._error_raised = True
            raise self._error

    @property
    def waiting(self) -> int:
        """Batches handed over and not sent yet."""
        with self._changed:
            return len(self._queue)

    def _put_metrics(self, metrics: list[Metric]) -> None:
        for start in range(0, len(metrics), METRICS_PER_REQUEST):
            self._put(_Batch(metrics=tuple(metrics[start : start + METRICS_PER_REQUEST])))

    def _put(self, batch: _Batch) -> None:
        with self._changed:
            if self._error is not None:
                # Training stops on it, as it did when it logged in its own thread.
                self._error_raised = True
                raise self._error
            if self._closing:
                raise RegistryError(
                    f"the metrics of run {self.run_id} are closed: {batch.describe()} handed "
                    "over after close()"
                )
            self._queue.append(batch)
            self._changed.notify_all()

    # --- The sender thread ------------------------------------------------------------------

    def _send_all(self) -> None:
        while True:
            with self._changed:
                while not self._queue and not self._closing:
                    self._changed.wait()
                if not self._queue:
                    return
                taken, batch = self._head()
            try:
                self._send(batch)
            except Exception as e:  # kept for the training thread, which raises it
                log.warning("run %s: %s not sent: %s", self.run_id, batch.describe(), e)
                with self._changed:
                    self._error = e
                    self._changed.notify_all()
                return
            with self._changed:
                for _ in range(taken):
                    self._queue.popleft()
                self._changed.notify_all()

    def _head(self) -> tuple[int, _Batch]:
        """The batches at the head of the queue that fit one request, merged: (how many)."""
        metrics: list[Metric] = []
        params: list[Param] = []
        taken = 0
        for batch in self._queue:
            if taken and (
                len(metrics) + len(batch.metrics) > METRICS_PER_REQUEST
                or len(params) + len(batch.params) > PARAMS_PER_REQUEST
            ):
                break
            metrics += batch.metrics
            params += batch.params
            taken += 1
        return taken, _Batch(tuple(metrics), tuple(params))

    def _send(self, batch: _Batch) -> None:
        """Send `batch`; one cut off in flight, only what the run does not hold yet."""
        for tries in range(RESENDS + 1):
            try:
                self._store.log_batch(
                    self.run_id, metrics=list(batch.metrics), params=list(batch.params)
                )
                return
            except RegistryError:
                # Not answered: the client waited out what it could. Written or not, the run
                # says (reading it waits out an outage again, or fails at once past the bound).
                if tries == RESENDS:
                    raise
                batch = self._unwritten(batch)
                if not batch:
                    return
            except MlflowException as e:
                raise RegistryError(
                    f"MLflow refused {batch.describe()} of run {self.run_id}: {e}"
                ) from e

    def _unwritten(self, batch: _Batch) -> _Batch:
        """The part of `batch` the run does not hold: its metric points not in their history,
        and its params (sending a param again with its value is allowed)."""
        held: set[tuple[str, int, int]] = set()
        for key in sorted({m.key for m in batch.metrics}):
            held |= {_key(m) for m in self._store.get_metric_history(self.run_id, key)}
        metrics = tuple(m for m in batch.metrics if _key(m) not in held)
        return _Batch(metrics, batch.params)
