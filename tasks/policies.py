"""What the pipeline's steps share in how Prefect runs them: which failures are retried, which
results are reused within a flow run, and which arguments are handed over whole."""

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from prefect.cache_policies import INPUTS, RUN_ID, TASK_SOURCE
from prefect.client.schemas.objects import State
from prefect.utilities.annotations import opaque

from mint_core.errors import MintError, NotReadyError, RegistryError, ServiceError

ONCE_PER_RUN = TASK_SOURCE + INPUTS + RUN_ID
"""Within one flow run (first attempt or a rerun of it), same step + same inputs = same
result: a rerun of a failed run skips training and reuses the revision it registered."""


def transient(task: object, task_run: object, state: State) -> bool:
    """Whether a failed step may go otherwise if tried again: a service that did not answer
    (or an error MinT did not foresee), not a refusal that would be the same every time (a
    bad data file, a missing revision, a digest mismatch)."""
    error = state.result(raise_on_failure=False)
    return not isinstance(error, MintError) or isinstance(
        error, ServiceError | RegistryError | NotReadyError
    )


P = ParamSpec("P")
R = TypeVar("R")


def handed_whole(step: Callable[P, R]) -> Callable[P, R]:
    """`step` (a task) called with each argument handed over whole (Prefect's `opaque`). Each is
    still linked to the step that returned it, so the run's graph keeps its edges, but Prefect
    does not walk into it looking for futures: it walks every argument twice a call, and a
    dataset's walk visits every row (0.25 s per 12,800 rows, so seconds a release at a user's
    scale, for nothing: MinT's steps hand each other values, never futures)."""

    @functools.wraps(step)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        whole = {name: opaque(value) for name, value in kwargs.items()}
        return step(*map(opaque, args), **whole)  # type: ignore[arg-type]

    return call
