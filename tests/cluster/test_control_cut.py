"""The control host cut off (issue 36, item 5): the serve hosts go on serving what they hold
and say `degraded`, the gateway goes on routing, no alias moves; once ctl's link is back every
worker catches up and a promotion works (tests/cluster/scenarios_serving.py)."""

import json
from pathlib import Path

from tests.cluster import roles, scenarios_serving


def test_serving_goes_on_without_the_control_host_and_catches_up(
    mint_cluster: roles.Booted, tmp_path: Path
) -> None:
    figures = scenarios_serving.control_cut(mint_cluster, tmp_path)
    print(json.dumps(figures.as_json(), indent=1))
    assert figures.requests_while_cut > 0
    assert figures.served_while_cut, figures
    assert figures.degraded_seen, figures
    assert figures.alias_moves_while_cut == 0
    assert figures.catch_up_s >= 0
    assert figures.promote_ok, figures
