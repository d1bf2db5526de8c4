"""A release across hosts (issue 36, item 5): started through the Prefect API on ctl, its flow
run runs on a train host, trains there on rows seeded into ctl's S3, registers on ctl, is
admitted and prewarmed on both serve hosts and activated, and the client host gets answers by
the new revision through the gateway (tests/cluster/scenarios.py)."""

import json
from pathlib import Path

from tests.cluster import roles, scenarios


def test_a_release_runs_on_a_train_host_and_reaches_the_client(
    mint_cluster: roles.Booted, tmp_path: Path
) -> None:
    figures = scenarios.release_across_hosts(mint_cluster, tmp_path)
    print(json.dumps(figures.as_json(), indent=1))
    assert figures.flow_run_host in roles.TRAIN
    assert figures.serve_hosts_ready == len(roles.SERVE)
    assert figures.revision.endswith(":r1"), figures.revision
    expected = {"scheduled->running", "data", "train", "freeze", "pack", "export", "register"}
    expected |= {"admit", "prewarm", "activate", "client_sees"}
    assert expected <= set(figures.stage_s), figures.stage_s
    assert figures.total_s > 0
