"""A serve host leaving under load (issue 48, item 3): its `mint up` sent SIGTERM while long
generations run on it through the gateway, once through its relay (a load balancer's place)
and once advertising its own URL (each again while no long generation was in flight on it as
it left). It says it is leaving, keeps its listener until the gateway has stopped sending to
it, finishes what it has, then exits: no request fails, and every long generation in flight
completes. It is started again as booted (tests/cluster/scenarios_serving.py)."""

import json
from pathlib import Path

from tests.cluster import roles, scenarios_serving


def test_a_leaving_serve_host_finishes_its_requests_and_fails_none(
    mint_cluster: roles.Booted, tmp_path: Path
) -> None:
    figures = scenarios_serving.serve_leave(mint_cluster, tmp_path)
    print(json.dumps(figures.as_json(), indent=1))
    last = {p.via: p for p in figures.phases}  # a leave with nothing long in flight is retried
    assert list(last) == ["relay", "direct"]
    assert all(p.in_flight_at_leave > 0 for p in last.values()), figures
    assert figures.failed_requests == 0, figures
    assert figures.in_flight_completed == figures.in_flight_at_leave, figures
