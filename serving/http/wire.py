"""The worker's wire types, written once: what its admin and status routes answer and what
its clients (`serving.http.client`, the gateway) send and read. Light (pydantic, no engine):
the gateway imports it.

Routes return `Model(...).model_dump(mode="json")` and keep `dict[str, object]` as their return
type: a `response_model` would have the fuzz lanes validate every answer against it."""

from typing import TYPE_CHECKING, Literal, Self

from pydantic import BaseModel, ConfigDict, Field

from mint_core.revisions import MAX_REVISION, RevisionId
from mint_core.states import Readiness

if TYPE_CHECKING:
    from serving.worker.readiness import ReadinessEntry, Residence

ASK_INTERVAL_S = 2.0
"""A worker is asked to admit the same revision by demand (by a peer, or by the gateway) at
most this often."""

ROUTING_REFRESH_S = 0.5
"""How often a gateway reads each worker's `/admin/routing`: a worker that says it is leaving
there is sent nothing new after the next read."""

AdmitPriority = Literal["normal", "rollback", "demand"]
"""`mint_core.planning.admission.Priority`, by name: `rollback` goes first, `demand` is a
request's (a peer's or the gateway's)."""


# `POST /admin/admit`: queue a revision for prewarm on a worker. (No docstring: it would become
# the description in the worker's OpenAPI document, which this type's move must leave as it was.)
class AdmitRequest(BaseModel):
    model_config = ConfigDict(frozen=True)

    adapter: str
    revision: int = Field(ge=1, le=MAX_REVISION)
    priority: AdmitPriority = "normal"

    @classmethod
    def of(cls, revision: RevisionId, priority: AdmitPriority = "normal") -> Self:
        return cls(adapter=revision.adapter, revision=revision.number, priority=priority)


class RevisionReadiness(BaseModel):
    """One revision's readiness on a worker, as `/v1/adapters/{name}`, admission and a
    not-ready error show it."""

    model_config = ConfigDict(frozen=True)

    id: str
    adapter: str
    revision: int
    state: Readiness
    since: float
    """Unix time the revision entered `state`."""
    reason: str | None = None
    """Why it failed, for `failed`."""
    queue_position: int | None = None
    """For `queued`: how many queued revisions go before it."""

    @classmethod
    def of(cls, entry: "ReadinessEntry") -> Self:
        return cls(**_readiness_fields(entry))


class Residency(BaseModel):
    """Where one revision's weights are on a worker."""

    model_config = ConfigDict(frozen=True)

    host: bool
    device_slot: int | None
    pins: int
    """Requests running on its device slot now."""


class RevisionStatus(RevisionReadiness):
    """A revision's readiness and, beside it, where its weights are."""

    residency: Residency

    @classmethod
    def with_residence(cls, entry: "ReadinessEntry", residence: "Residence") -> Self:
        where = Residency(
            host=residence.host, device_slot=residence.device_slot, pins=residence.pins
        )
        return cls(**_readiness_fields(entry), residency=where)


class AdapterStatus(BaseModel):
    """`GET /v1/adapters/{name}`: each revision of an adapter the caller may use."""

    model_config = ConfigDict(frozen=True)

    adapter: str
    revisions: list[RevisionStatus]


class SyncAnswer(BaseModel):
    """`POST /admin/sync`: the revisions the worker admitted while catching up."""

    model_config = ConfigDict(frozen=True)

    admitted: list[str]


class Routing(BaseModel):
    """`GET /admin/routing`: what a gateway routes by."""

    model_config = ConfigDict(frozen=True)

    base_model: str
    base_digest: str
    ready: list[str]
    """The revisions ready on the worker."""
    device_slots: list[str]
    """The engine keys in its device slots (adapter affinity)."""
    in_flight: int
    """Its queue and batch: the load."""
    degraded_reason: str | None = None
    leaving: bool = False
    """It was told to stop and finishes what it has: send it nothing new
    (`serving.worker.leaving`)."""


def _readiness_fields(entry: "ReadinessEntry") -> dict[str, object]:
    return {
        "id": str(entry.revision),
        "adapter": entry.revision.adapter,
        "revision": entry.revision.number,
        "state": entry.state,
        "since": entry.since,
        "reason": entry.reason,
        "queue_position": entry.queue_position,
    }
