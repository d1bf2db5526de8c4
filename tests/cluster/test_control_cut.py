"""The control host cut off (issue 36, item 5): the serve hosts go on serving what they hold
and say `degraded`, the gateway goes on routing, no alias moves; once ctl's link is back every
worker catches up and a promotion works (tests/cluster/scenarios_serving.py). Meanwhile a
release trains on a train host (issue 48, item 4): its steps go on through the cut (their loss
is sent once ctl answers again), its run's loss curve has every step once, in order, and the
release completes."""

import json
from functools import partial
from pathlib import Path

from tasks.training import _TrainingProgress
from tests.cluster import roles, scenarios, scenarios_serving

TRAIN_STEPS = 1000
"""Enough that training spans the cut and the catch-up on a busy 2-core machine."""


def test_serving_and_training_go_on_without_the_control_host_and_catch_up(
    mint_cluster: roles.Booted, tmp_path: Path
) -> None:
    cut = partial(scenarios_serving.control_cut, mint_cluster, tmp_path)
    figures, training = scenarios.training_through(mint_cluster, cut, steps=TRAIN_STEPS)
    print(json.dumps(figures.as_json() | training.as_json(), indent=1))
    assert figures.requests_while_cut > 0
    assert figures.served_while_cut, figures
    assert figures.degraded_seen, figures
    assert figures.alias_moves_while_cut == 0
    assert figures.catch_up_s >= 0
    assert figures.promote_ok, figures
    assert training.completed, training
    assert training.losses_once_in_order, training
    # Training stalled at its next loss report for as long as ctl was away: no more.
    assert training.steps_in_window > _TrainingProgress.LOG_EVERY, training
    assert training.longest_pause_s < figures.cut_s / 2, (training, figures.cut_s)
