"""How a flow run's log tells a MinT error: once, as its message, per flow run; a bug keeps its
traceback. The filter on Prefect's run loggers, fed the records Prefect's engines log (the
integration lane checks a real run's log through the Prefect API)."""

import logging

from flows.ending import OneLineMintErrors
from mint_core.errors import MintError, NotFoundError

RUN = "6d3c1f0e-0000-0000-0000-000000000001"
OTHER_RUN = "6d3c1f0e-0000-0000-0000-000000000002"
TASK_RUN = "6d3c1f0e-0000-0000-0000-00000000000a"


def raised(error: BaseException) -> BaseException:
    """`error` with a traceback, as an engine's handler holds it."""
    try:
        raise error
    except BaseException as e:
        return e


def record(
    message: str, error: BaseException | None = None, level: int = logging.ERROR, **extra: str
) -> logging.LogRecord:
    exc_info = (type(error), error, error.__traceback__) if error is not None else None
    entry = logging.LogRecord("prefect.flow_runs", level, __file__, 1, message, (), exc_info)
    entry.__dict__.update(extra)
    return entry


def test_a_mint_error_is_one_line_once_per_flow_run() -> None:
    lines = OneLineMintErrors()
    error = raised(NotFoundError("adapter 'typo-bot' is not registered"))
    first = record("Encountered exception during execution: %r", error, flow_run_id=RUN)
    assert lines.filter(first)
    assert (first.getMessage(), first.levelno, first.exc_info) == (str(error), logging.ERROR, None)
    # The engine's second report of it in the same run is dropped; a parent run tells it too.
    assert not lines.filter(record("Engine execution exited", error, flow_run_id=RUN))
    assert lines.filter(record("Encountered exception", error, flow_run_id=OTHER_RUN))


def test_a_bug_keeps_its_traceback() -> None:
    error = raised(KeyError("missing"))
    entry = record("Encountered exception during execution", error, flow_run_id=RUN)
    assert OneLineMintErrors().filter(entry)
    assert entry.exc_info is not None and entry.exc_info[1] is error
    assert entry.getMessage() == "Encountered exception during execution"


def test_a_task_runs_final_state_is_info_its_error_told_once() -> None:
    lines = OneLineMintErrors()
    error = raised(MintError("data file /nowhere.jsonl does not exist"))
    task = {"flow_run_id": RUN, "task_run_id": TASK_RUN}
    failed = record("Task run failed with exception: %r", error, **task)
    finished = record("Finished in state Failed('Task run encountered an exception')", **task)
    assert lines.filter(failed) and lines.filter(finished)
    assert (failed.getMessage(), failed.levelno) == (str(error), logging.ERROR)
    assert finished.levelno == logging.INFO and finished.levelname == "INFO"
    # The flow that catches it has told nothing new.
    assert not lines.filter(record("Encountered exception", error, flow_run_id=RUN))
