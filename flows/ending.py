"""How a flow run ends on a MinT error: Failed, with the error's message as its state's message
and as the one ERROR line of its log, without a traceback.

A `MintError` is a user's mistake or a refusal (a data file that is not there, an adapter that
is not registered, a revision a gate rejected) and its message already says what to do. Left
to itself, Prefect 3.9 follows it with its traceback twice: the flow engine's "Encountered
exception during execution" and, in a deployment's run, the run's "Engine execution exited
with unexpected exception"; a task that raised it adds "Task run failed with exception" and an
ERROR "Finished in state Failed(...)". Any other exception is a bug in MinT and keeps every
traceback Prefect logs.

Every flow is declared as

    @flow(name="release", ...)
    @ends_on_mint_error
    def release(...): ...

and still raises the error to a caller in code (a test, `mint release`): Prefect raises a
failed run's error from its state. The log's records are put right by a filter on Prefect's run
loggers (`OneLineMintErrors`), which the first flow to start installs.

A flow called in a process that is then stopped (SIGTERM from an orchestrator, Ctrl-C: `mint
release`) ends Cancelled, not Crashed, and the caller gets CancelledRun.
"""

import functools
import logging
from collections.abc import Callable
from typing import ParamSpec, TypeVar, cast

from prefect.exceptions import TerminationSignal
from prefect.states import Cancelled, Failed

from mint_core.errors import MintError
from tasks.runs import run_log

P = ParamSpec("P")
R = TypeVar("R")

RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")
"""Prefect's loggers of flow and task runs: what they log is the run's log in the Prefect UI."""
_TASK_FINISHED = "Finished in state "
"""How Prefect's task engine begins its report of a task run's final state (ERROR unless it
completed)."""
_TOLD_IN = "_mint_told_in_runs"
"""Attribute of a MintError: the flow runs whose log has told it. (Exceptions cannot be weakly
referenced, so where one was told travels with it.)"""


def ends_on_mint_error(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn`, a flow's function, ending its run Failed with a MintError's message (told once in
    the run's log) instead of raising it into Prefect's engine; and Cancelled when the process
    that called it is stopped (`_stopped_by_its_caller`)."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        _filter_run_logs()
        try:
            return fn(*args, **kwargs)
        except (KeyboardInterrupt, TerminationSignal) as stop:
            if not _stopped_by_its_caller():
                raise
            how = "SIGTERM" if isinstance(stop, TerminationSignal) else "an interrupt (Ctrl-C)"
            message = f"cancelled: the process running it was stopped by {how}"
            run_log().warning("%s", message)
            # The engine then raises CancelledRun to the caller (`mint_cli.training.run_flow`
            # turns that back into the interruption it was).
            return cast(R, Cancelled(message=message))
        except MintError as error:
            flow_run = _current_flow_run()
            if _tell(error, flow_run):
                run_log().error("%s", error)
            if _pause_expired(flow_run):
                # Prefect's server answers any state proposed for a run whose pause timed out
                # with its own Failed ("never resumed"), which carries no error: raised, the
                # error stays with the engine, which raises it to a caller in code (the filter
                # keeps the engine's report of it out of the log).
                raise
            # A state returned by the flow function is the run's final state; the engine then
            # raises `error` from it to a caller in code.
            return cast(R, Failed(message=str(error), data=error))

    return run


class OneLineMintErrors(logging.Filter):
    """On Prefect's run loggers: a record carrying a MintError becomes one ERROR line, the
    error's message, the first time the error reaches a flow run's log, and is dropped after
    that (the engine's second report). A task run's report of its final state ("Finished in
    state Failed(...)") is INFO, as Prefect logs a flow run's: the error itself is told by the
    record that carries it, or by the flow (a task whose retry condition refused a MintError
    logs nothing else), and a bug's traceback stays an ERROR record of its own."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, MintError):
            if not _tell(error, getattr(record, "flow_run_id", None)):
                return False
            record.msg, record.args = str(error), ()
            record.exc_info, record.exc_text = None, None
        elif (
            getattr(record, "task_run_id", None) is not None
            and record.levelno >= logging.ERROR
            and str(record.msg).startswith(_TASK_FINISHED)
        ):
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        return True


def _tell(error: MintError, flow_run: object) -> bool:
    """Whether `error` is still to be told in `flow_run`'s log; from now on it counts as told."""
    told: set[str] = getattr(error, _TOLD_IN, set())
    if str(flow_run) in told:
        return False
    setattr(error, _TOLD_IN, told | {str(flow_run)})
    return True


def _stopped_by_its_caller() -> bool:
    """Whether the run now stopped (SIGTERM, which Prefect's engine raises as TerminationSignal
    while a flow runs, or Ctrl-C) is the top-level run of a flow called in this process (`mint
    release`), which ends Cancelled rather than Crashed: the user or an orchestrator stopped it
    on purpose. A deployment's run is left to Prefect (its runner or worker cancels it, or
    marks it Crashed when the host goes down), and a subflow's to the flow that called it."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    flow_run = context.flow_run if context is not None else None
    return (
        flow_run is not None
        and flow_run.deployment_id is None
        and flow_run.parent_task_run_id is None
    )


def _current_flow_run() -> object:
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    return context.flow_run.id if context is not None and context.flow_run is not None else None


def _pause_expired(flow_run: object) -> bool:
    """Whether `flow_run` (an id, None outside a run) is paused still (its pause timed out:
    the approval forms' `FlowPauseTimeout`)."""
    if flow_run is None:
        return False
    from prefect import get_client

    with get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run).state  # type: ignore[arg-type]
    return state is not None and state.is_paused()


def _filter_run_logs() -> None:
    """Put OneLineMintErrors on Prefect's run loggers, once per process. Done when a flow
    starts rather than at import: importing MinT's flows changes no logging."""
    for name in RUN_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, OneLineMintErrors) for f in logger.filters):
            logger.addFilter(OneLineMintErrors())
