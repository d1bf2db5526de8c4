"""What a worker says about each revision's readiness: its entries, its "not ready" error, and
the events of held alias moves. Plain records without any engine, so the HTTP layer and the
gateway can name them without loading torch."""

from dataclasses import dataclass
from enum import StrEnum

from mint_core.alias_intents import HeldMove
from mint_core.errors import NotReadyError
from mint_core.revisions import RevisionId
from mint_core.states import Readiness

__all__ = ["AliasEvent", "AliasEventKind", "ReadinessEntry", "RevisionNotReady"]


@dataclass(frozen=True)
class ReadinessEntry:
    """One revision's state on this worker."""

    revision: RevisionId
    state: Readiness
    since: float
    """Unix time the revision entered `state`."""
    reason: str | None = None
    """Why it failed, for `failed`."""
    queue_position: int | None = None
    """For `queued`: how many queued revisions go before it."""


class AliasEventKind(StrEnum):
    HELD = "held"
    """An alias moved outside the pipeline: the worker keeps serving the previous target."""
    RELEASED = "released"
    """The pipeline moved the alias (or the registry's alias came back): followed again."""


@dataclass(frozen=True)
class AliasEvent:
    """A held alias move appearing or ending on this worker."""

    at: float
    """Unix time the worker saw it."""
    kind: AliasEventKind
    move: HeldMove


class RevisionNotReady(NotReadyError):
    def __init__(self, entry: ReadinessEntry) -> None:
        super().__init__(f"{entry.revision} is {entry.state} on this worker, not ready")
        self.entry = entry
