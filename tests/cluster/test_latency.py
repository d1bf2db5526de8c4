"""Latency between hosts (issue 36, item 5): 20 ms added between the gateway's host and the
serve hosts (each serve worker's relay, changed live), what the gateway adds to a client's
p50 and how long a promotion takes to reach the client, with and without the delay
(tests/cluster/scenarios_serving.py). Figures, not thresholds: the machine is noisy."""

import json
from pathlib import Path

from tests.cluster import roles, scenarios_serving


def test_the_gateway_and_activations_under_added_latency(
    mint_cluster: roles.Booted, tmp_path: Path
) -> None:
    figures = scenarios_serving.latency(mint_cluster, tmp_path)
    print(json.dumps(figures.as_json(), indent=1))
    assert {"gateway@0", "direct@0", "relay@0", "gateway@20", "direct@20"} <= set(figures.p50_ms)
    # The delay is on the gateway's hop to the worker, not the client's own to the worker.
    assert figures.added_p50_ms_20ms > figures.added_p50_ms_no_delay
    assert figures.activation_s_no_delay > 0 and figures.activation_s_20ms > 0
    assert all(path.read_text() == "0" for path in mint_cluster.delay_files.values())
