"""What happened to the generations a worker answered (`serving.worker.outcomes`): clients score
them (`POST /v1/feedback`), a canary is watched by the summary (`GET /admin/outcomes`), and
each principal's usage of each revision is `GET /admin/usage` (what `mint usage` adds up)."""

from typing import Annotated

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, Field

from serving.http.context import CurrentCaller, CurrentWorker, admin_only
from serving.protocols import Text

router = APIRouter()
admin_router = APIRouter(prefix="/admin", dependencies=[Depends(admin_only)])


class FeedbackRequest(BaseModel):
    request_id: Text = Field(min_length=1, max_length=200)
    """A response's `X-Mint-Request-Id`."""
    score: float = Field(ge=0, le=1, allow_inf_nan=False)
    """How good the generated text was, from 0 (wrong) to 1 (right)."""


@router.post("/v1/feedback")
def feedback(body: FeedbackRequest, caller: CurrentCaller) -> dict[str, object]:
    """A client's score of one response, by its request id: one per response, from the
    principal that asked."""
    served = caller.worker.outcomes.score(body.request_id, body.score, caller.principal)
    return {"request_id": body.request_id, "revision": served, "score": body.score}


@admin_router.get("/outcomes")
def outcomes(
    worker: CurrentWorker, since: Annotated[float, Query(ge=0)] = 0.0
) -> dict[str, object]:
    """Per revision, the requests answered at or after `since` (Unix time): requests,
    errors and their rate, p50/p95 latency in seconds, feedback and its mean score. What a
    canary is watched by."""
    summary = worker.outcomes.summary(since)
    return {"since": since, "revisions": {name: o.to_json() for name, o in summary.items()}}


@admin_router.get("/usage")
def usage(worker: CurrentWorker, since: Annotated[float, Query(ge=0)] = 0.0) -> dict[str, object]:
    """Each principal's usage of each revision from the minute of `since` (Unix time) on:
    requests, errors, refusals over a quota, prompt and generated tokens, seconds in queue.
    `kept_since`: from when this worker still knows it (later than `since` if it let older
    minutes go)."""
    rows, kept_since = worker.outcomes.usage(since)
    return {"since": since, "kept_since": kept_since, "rows": [row.to_json() for row in rows]}
