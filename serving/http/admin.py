"""The admin endpoints under `/admin` (besides `/admin/outcomes`): admission, sync, what a
gateway routes by, and the event log. With API keys, only admin principals may call them
(`context.admin_only`, on the router: a route added here is guarded like the others)."""

from fastapi import APIRouter, Depends

from mint_core.planning.admission import Priority
from mint_core.revisions import RevisionId, check_adapter_name
from serving.http.context import CurrentDrain, CurrentWorker, admin_only
from serving.http.wire import AdmitRequest, RevisionReadiness, Routing, SyncAnswer

router = APIRouter(prefix="/admin", dependencies=[Depends(admin_only)])


@router.post("/admit", status_code=202)
def admit(body: AdmitRequest, worker: CurrentWorker) -> dict[str, object]:
    revision = RevisionId(check_adapter_name(body.adapter), body.revision)
    entry = worker.admit_known(revision, Priority[body.priority.upper()])
    return RevisionReadiness.of(entry).model_dump(mode="json")


@router.post("/sync", status_code=202)
def sync(worker: CurrentWorker) -> dict[str, object]:
    """Catch up with the registry now (activation calls it after moving an alias)."""
    return SyncAnswer(admitted=[str(r) for r in worker.sync()]).model_dump(mode="json")


@router.get("/routing")
def routing(worker: CurrentWorker, drain: CurrentDrain) -> dict[str, object]:
    """What `mint gateway` routes by: the base, the ready revisions, the engine keys in
    device slots (adapter affinity), the load, and whether it is leaving."""
    ready, slots = worker.routing()
    return Routing(
        base_model=worker.base.model_id,
        base_digest=worker.base.digest,
        ready=[str(r) for r in ready],
        device_slots=slots,
        in_flight=worker.queue_depth + worker.batch_size,
        degraded_reason=worker.degraded,
        leaving=drain.leaving,
    ).model_dump(mode="json")


@router.get("/events")
def events(worker: CurrentWorker) -> dict[str, object]:
    """The last readiness changes on this worker (`serving.worker.readiness.EVENT_LOG_LENGTH`),
    oldest first; and the last held alias moves that appeared or ended."""
    return {
        "events": [
            {"at": e.since, "id": str(e.revision), "state": e.state.value, "reason": e.reason}
            for e in worker.events()
        ],
        "alias_events": [
            {"at": e.at, "kind": e.kind.value, **e.move.to_json()} for e in worker.alias_events()
        ],
    }
