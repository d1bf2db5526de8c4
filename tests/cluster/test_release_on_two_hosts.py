"""A release trained on both train hosts (issue 37): started through the Prefect API on ctl with
nnodes=2, node 0 on its own train host and a `train-node` run on the other, gloo between them
over the cluster's network (tests/cluster/scenarios_ranks.py). First a rank killed mid-training
fails the whole launch in bounded time and leaves nothing; then the rerun, the same adapter on
two hosts again, registers, serves and says how it was trained. Runs before test_train_killed
(file name order), which leaves a train host dead."""

import json
from pathlib import Path

from tests.cluster import roles, scenarios_ranks

FAILED_WITHIN_S = 120.0
"""From node 1's rank SIGKILLed to the release run ended: gloo sees the closed connection at
rank 0's next all-reduce and torchrun ends the rest, well before the launch's timeout (300 s)."""


def test_a_rank_killed_on_the_other_host_fails_the_release_and_leaves_nothing(
    mint_cluster: roles.Booted,
) -> None:
    figures = scenarios_ranks.rank_killed(mint_cluster)
    print(json.dumps(figures.as_json(), indent=1))
    assert {figures.release_host, figures.killed_host} == set(roles.TRAIN), figures
    assert figures.final_state in ("FAILED", "CRASHED"), figures
    assert figures.failed_s < FAILED_WITHIN_S, figures
    assert figures.node_run_state in ("FAILED", "CRASHED", "CANCELLED"), figures
    assert figures.registered == 0, figures
    assert figures.ranks_left == {}, figures
    assert figures.slot_free, figures


def test_a_release_on_two_train_hosts_registers_serves_and_says_so(
    mint_cluster: roles.Booted, tmp_path: Path
) -> None:
    """The same adapter as the killed launch's: this is its rerun (and r1: nothing before)."""
    figures = scenarios_ranks.release_on_two_hosts(mint_cluster, tmp_path)
    print(json.dumps(figures.as_json(), indent=1))
    release = figures.release
    assert release.revision.endswith(":r1"), release
    assert release.serve_hosts_ready == len(roles.SERVE)
    assert {release.flow_run_host, figures.node_run_host} == set(roles.TRAIN), figures
    hosts = [release.flow_run_host, figures.node_run_host]
    assert figures.trained_with == {
        "world_size": 2,
        "train_hosts": hosts,
        "dist_backend": "gloo",
        "sharded_base": False,
    }, figures.trained_with
    params, tags = figures.mlflow_params, figures.mlflow_tags
    assert (params.get("world_size"), params.get("nnodes"), params.get("nproc_per_node")) == (
        "2",
        "2",
        "1",
    ), params
    assert tags.get("mint.world_size") == "2", tags
    assert tags.get("mint.train_hosts") == ",".join(hosts), tags
    assert tags.get("mint.dist_backend") == "gloo", tags
    assert {"train", "register", "activate", "client_sees"} <= set(release.stage_s)
