"""A serve host cut off under client load (issue 36, item 5): the revisions it held answer
from the other serve host, the requests that fail were in flight to it and got a clear 502
or 503; once its link is back it rejoins, takes its share back, and nothing else moves
(tests/cluster/scenarios_serving.py)."""

import json
from pathlib import Path

from tests.cluster import roles, scenarios_serving


def test_a_cut_serve_host_fails_over_and_rejoins_with_its_share(
    mint_cluster: roles.Booted, tmp_path: Path
) -> None:
    figures = scenarios_serving.serve_cut(mint_cluster, tmp_path)
    print(json.dumps(figures.as_json(), indent=1))
    assert figures.requests > 0
    assert figures.failed_requests <= figures.in_flight_at_cut, figures
    assert set(figures.failed_status) <= scenarios_serving.OK_STATUSES, figures
    assert figures.moved_after_rejoin == 0
    assert figures.recovery_s > 0 and figures.rejoin_s > 0
