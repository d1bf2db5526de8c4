"""What the pipeline's steps share in how Prefect runs them: which failures are retried, and
which results are reused within a flow run."""

from prefect.cache_policies import INPUTS, RUN_ID, TASK_SOURCE
from prefect.client.schemas.objects import State

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
