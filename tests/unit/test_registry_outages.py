"""How long calls wait out an MLflow that does not answer: the bound is the outage's, not each
call's; the pauses grow; past the bound calls fail at once until the server answers; one line
when an outage starts (with the bound) and one when it ends."""

import logging

import pytest

from mint_core.registry_outages import LOGGER, Outages

URI = "http://mlflow:5000"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_outage_is_waited_out_once_for_its_bound_whatever_the_calls(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    clock = Clock()
    outages = Outages(wait_s=10, clock=clock)
    pauses = []
    while (pause := outages.failed(URI, "Connection refused")) is not None:
        pauses.append(pause)
        clock.now += pause
    assert pauses == [0.5, 1.0, 2.0, 4.0, 2.5]  # doubling, the last cut to the bound
    assert outages.waited_s(URI) == 10
    assert outages.failed(URI, "Connection refused") is None  # another call: at once
    clock.now += 30
    outages.answered(URI)
    assert outages.waited_s(URI) == 0
    assert outages.failed(URI, "Connection refused") == 0.5  # a new outage, a new wait
    lines = [record.getMessage() for record in caplog.records]
    assert lines == [
        f"MLflow at {URI} (MLFLOW_TRACKING_URI) does not answer (Connection refused); trying "
        "again for up to 10 s (MINT_REGISTRY_RETRY_S)",
        f"MLflow at {URI} answers again, after 40 s",
        f"MLflow at {URI} (MLFLOW_TRACKING_URI) does not answer (Connection refused); trying "
        "again for up to 10 s (MINT_REGISTRY_RETRY_S)",
    ]


def test_without_a_bound_calls_fail_at_once_and_say_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    outages = Outages(wait_s=0, clock=Clock())
    assert outages.failed(URI, "Connection refused") is None
    outages.answered(URI)
    assert caplog.records == []
