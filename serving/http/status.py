"""What a worker says about itself: `/health` (the probe the fleet reads), `/metrics`
(Prometheus) and `/v1/adapters/{name}` (readiness and residency of each revision the caller may
use)."""

from fastapi import APIRouter
from fastapi.responses import Response

from mint_core.revisions import check_adapter_name
from serving.http.context import CurrentCaller, CurrentDrain, CurrentWorker
from serving.http.wire import AdapterStatus, RevisionStatus

router = APIRouter()


@router.get("/health")
def health(worker: CurrentWorker, drain: CurrentDrain, response: Response) -> dict[str, object]:
    """`ok`, or `degraded` while the registry cannot be reached (serving goes on) or the
    engine is down (being restarted), or `leaving` (with 503, so that a load balancer's probe
    takes it out) once told to stop while it finishes what it has; the backend, and the base
    it serves: model id, weights digest, family and context length."""
    base = worker.base
    status = "degraded" if worker.degraded else "ok"
    if drain.leaving:
        status, response.status_code = "leaving", 503
    return {
        "status": status,
        "degraded_reason": worker.degraded,
        "last_sync": worker.last_sync,
        "backend": worker.backend_kind,
        "base_model": base.model_id,
        "base_digest": base.digest,
        "base_family": base.family,
        "context_length": base.context_length,
        "queue_depth": worker.queue_depth,
        "batch_size": worker.batch_size,
        "request_path_loads": worker.request_path_loads,
        "request_path_fetches": worker.request_path_fetches,
        "tiers": worker.tiers(),
        "placement": {"me": worker.peers.me, "members": list(worker.peers.members)},
        # Aliases moved outside the pipeline: each serves the pipeline's last target.
        "held_alias_moves": [move.to_json() for move in worker.held_moves],
    }


@router.get("/metrics")
def metrics(worker: CurrentWorker) -> Response:
    return Response(worker.exposition(), media_type="text/plain; version=0.0.4")


@router.get("/v1/adapters/{name}")
def adapter_status(name: str, caller: CurrentCaller) -> dict[str, object]:
    """Each revision of `name` on this worker that the caller may use (admins, and everyone
    on a worker without API keys: all of them, as the pipeline reads readiness with its
    admin key), with where its weights are."""
    check_adapter_name(name)
    sees_all = caller.open_worker or caller.admin
    revisions = [
        RevisionStatus.with_residence(entry, residence)
        for entry, residence in caller.worker.adapter_status(name, caller.principal, sees_all)
    ]
    return AdapterStatus(adapter=name, revisions=revisions).model_dump(mode="json")
