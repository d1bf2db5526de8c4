"""One exception hierarchy for MinT.

Every error says which value was wrong and what to do about it. Category errors also inherit
the standard-library error they stand in for, so callers that only know Python's errors can
still catch them.

A value an error quotes is what a caller sent, of any length: it is cut short (`clip`).
"""

ECHO_LIMIT = 200
"""Longest stretch of a value (adapter id, model name, field value) an error message echoes;
the rest becomes an ellipsis. A value is what the caller sent: it may be any length."""


def clip(text: str, limit: int = ECHO_LIMIT) -> str:
    """`text`, cut to `limit` characters and an ellipsis if longer."""
    return text if len(text) <= limit else text[:limit] + "…"


class MintError(Exception):
    """Base of every error MinT raises on purpose."""


class ConfigurationError(MintError, ValueError):
    """A setting, parameter or request field has a value MinT cannot use."""


class NotFoundError(MintError, LookupError):
    """An adapter, revision, alias or artifact does not exist."""


class IntegrityError(MintError):
    """Bytes on disk or in a store do not match the digest recorded for them."""


class BaseMismatchError(MintError):
    """An adapter was trained on a different base model than the one MinT serves."""


class RegistryError(MintError):
    """The model registry (MLflow) refused or failed an operation."""


class TransitionError(MintError):
    """A stage or readiness change that the transition table does not allow."""


class NotReadyError(MintError):
    """A revision exists but is not ready to serve on this worker."""


class ServiceError(MintError):
    """A process MinT starts (MLflow server, worker) failed to start or answer."""


class UnavailableError(ServiceError):
    """Nothing can take the request right now, through no fault of the request or its
    revision: try again shortly (503 with Retry-After)."""


class EngineUnavailableError(UnavailableError):
    """The serving engine is down (a vLLM process died and is being restarted): not the
    request's or the revision's fault; try again shortly."""


class AuthenticationError(MintError, PermissionError):
    """A request carried an API key that names no principal."""


class AccessDeniedError(MintError, PermissionError):
    """A principal asked for a revision its policy record does not allow it to use."""


class RateLimitedError(MintError):
    """A principal is over a quota of its tenancy terms (`mint_core.tenancy`): the request
    was not started; `retry_after_s` says when the limit lets the next one in (429)."""

    def __init__(self, message: str, limit: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.limit = limit
        self.retry_after_s = retry_after_s


class RolloutBusyError(MintError):
    """Another roll-out of the same adapter held its roll-out slot for the whole wait: nothing
    was changed, and the same command can run again once that one has finished. (Not a
    TimeoutError: Prefect would report the flow run itself as timed out.)"""


class SlotNotHeldError(MintError):
    """An alias move was given a roll-out slot that is another adapter's or no longer held:
    the caller must move aliases inside `rollout_lock(adapter)` with the slot it yields."""


class RejectedError(MintError):
    """A gate (evaluation, approval or canary) stopped a revision before activation; the
    message carries the figures or the decision. `production` did not move."""


class TrainingFailedError(MintError):
    """A training process (a rank of a distributed launch) failed or was lost: the whole step
    failed, every rank was stopped and nothing was registered; a rerun starts it again."""


class DatasetError(ConfigurationError):
    """Training data that cannot be used: the message names `FILE:LINE` and the reason."""
