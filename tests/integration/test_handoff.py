"""`mint promote` and `mint rollback` hand their run to the runner serving the deployment only
where one is there to take it (control/handoff.py; a served run end to end is in
tests/integration/test_deployments.py): a deployment nobody polls is not handed off, and a run
that a vanished runner's deployment still advertises is cancelled before it starts, for the
command to run the flow itself."""

import pytest
from prefect import flow, get_client

from control import handoff
from tests.helpers import wait_until

pytestmark = pytest.mark.slow


@flow(name="handoff-probe")
def probe(adapter: str) -> str:
    return adapter


def test_a_deployment_nobody_serves_is_not_handed_a_run(
    prefect_api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFECT_API_URL", prefect_api)
    monkeypatch.setattr(handoff, "TAKEN_WITHIN_S", 1.0)
    deployment_id = probe.to_deployment(name="unserved").apply()
    with get_client(sync_client=True) as client:
        try:
            # Never polled: NOT_READY, so no run is made.
            assert handoff.run_where_served("handoff-probe/unserved", {"adapter": "a"}) is None
            assert all(run.deployment_id != deployment_id for run in client.read_flow_runs())
            # Polled once, as a runner does, by a runner that then went away: READY for a
            # minute, so the run is made, nobody takes it, and it is cancelled unstarted.
            client.get_scheduled_flow_runs_for_deployments([deployment_id])
            # Prefect marks it READY in a background task of its server, soon after the poll.
            wait_until(lambda: client.read_deployment(deployment_id).status.value == "READY", 30)
            assert handoff.run_where_served("handoff-probe/unserved", {"adapter": "b"}) is None
            (run,) = [r for r in client.read_flow_runs() if r.deployment_id == deployment_id]
            assert run.state is not None and run.state.is_cancelled(), run.state
            states = [state.type.value for state in client.read_flow_run_states(run.id)]
            assert states == ["SCHEDULED", "CANCELLED"]  # never ran
        finally:
            client.delete_deployment(deployment_id)
