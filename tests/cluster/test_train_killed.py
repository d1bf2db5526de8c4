"""A train host killed mid-training (issue 36, item 5): every process in it (its Prefect
worker, the flow run training there) SIGKILLed; the crash automation ends the run, nothing it
trained is registered, the adapter's roll-out slot is free, and a rerun sent to the other train
host's own queue succeeds there (tests/cluster/scenarios.py). The killed host stays dead: this
module runs after every other cluster scenario (files run in name order) and none needs it."""

import json

from tests.cluster import roles, scenarios


def test_a_train_host_killed_mid_training_leaves_nothing_and_a_rerun_succeeds(
    mint_cluster: roles.Booted,
) -> None:
    figures = scenarios.train_host_killed(mint_cluster)
    print(json.dumps(figures.as_json(), indent=1))
    assert figures.killed_host in roles.TRAIN and figures.killed_pids > 0
    assert figures.final_state in ("CRASHED", "FAILED"), figures
    assert figures.registered == 0
    assert figures.slot_free
    assert figures.rerun_ok, figures
    assert figures.rerun_host in roles.TRAIN and figures.rerun_host != figures.killed_host
