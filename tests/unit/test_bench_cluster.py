"""bench/cluster.py's results, without a cluster (the lane boots one, once, in tests/cluster/):
the JSON built from the scenario drivers' own figure types carries every figure the issue's
closing note quotes, the serve cut's timeline places each request around the cut, and the
picture draws from it; a kept bench/results/cluster.json carries them too."""

import dataclasses
import json
import typing
from pathlib import Path

import pytest

from bench import cluster, plots
from tests.cluster import scenarios, scenarios_serving

KEPT = Path(__file__).resolve().parents[2] / "bench" / "results" / "cluster.json"
SAMPLES: dict[object, object] = {float: 1.5, int: 2, str: "serve-1", bool: True, dict: {}, list: []}


def sample(kind: type) -> cluster.Figures:
    """An instance of a figures dataclass with every field given a value of its type."""
    values = {}
    for field in dataclasses.fields(kind):
        if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            values[field.name] = SAMPLES[typing.get_origin(field.type) or field.type]
    return kind(**values)


FIGURES = (
    scenarios.ReleaseFigures,
    scenarios_serving.ServeCutFigures,
    scenarios_serving.ControlCutFigures,
    scenarios_serving.LatencyFigures,
    scenarios_serving.ServeLeaveFigures,
    scenarios.TrainKilledFigures,
)


def answer(t_start: float, status: int | None, worker: str = "") -> dict[str, object]:
    """One line of tests/cluster/load.py."""
    headers = {"X-Mint-Worker": worker} if worker else {}
    error = None if status else "timeout"
    return {"t_start": t_start, "t_end": t_start + 0.1, "status": status, "error": error,
            "headers": headers}  # fmt: skip


def test_the_serve_cut_timeline_places_each_request_around_the_cut() -> None:
    workers = {"http://10.0.0.5:8001": "serve-1", "http://10.0.0.6:8001": "serve-2"}
    answers = {
        "sv-2": [answer(103.0, 200, "http://10.0.0.5:8001"), answer(99.0, 200, "http://10.0.0.6:8001"),
                 answer(100.5, None), answer(101.0, 502)],
        "sv-0": [answer(101.0, 200, "http://10.0.0.5:8001")],
    }  # fmt: skip
    made = cluster.timeline(answers, cut_at=100.0, rejoined_at=110.0, worker_roles=workers,
                            held=["sv-2"])  # fmt: skip
    assert made["link_up_s"] == 10.0
    first, second = made["lanes"]
    assert (first["adapter"], first["held_by_cut_host"]) == ("sv-0", False)
    assert second["t_start_s"] == [-1.0, 0.5, 1.0, 3.0]  # in the order sent
    assert second["t_end_s"] == [-0.9, 0.6, 1.1, 3.1]
    assert second["status"] == [200, None, 502, 200]
    assert second["worker"] == ["serve-2", "", "", "serve-1"]
    assert second["error"] == [None, "timeout", None, None]
    assert second["attempts"] == [1, 1, 1, 1]


def test_the_results_carry_every_figure_and_draw(tmp_path: Path) -> None:
    cut = cluster.timeline({"sv-1": [answer(100.5, 502)]}, 100.0, None, {}, ["sv-1"])
    result = cluster.summarize(
        [sample(kind) for kind in FIGURES], {"serve_cut": {"timeline": cut}}, {}, {"steps": 20},
        {"all": 60.0}, {"release": 40.0}, {"cpus": 2},
    )  # fmt: skip
    assert cluster.missing(result) == [] == result["missing"]
    assert set(cluster.SCENARIOS) <= set(result)
    assert result["serve_cut"]["timeline"] == cut
    json.dumps(result)  # as harness.write writes it
    png = plots.draw("cluster", result, tmp_path / "cluster.png")
    assert png is not None and png.read_bytes().startswith(b"\x89PNG")


def test_a_failed_scenario_is_reported_missing_and_the_rest_still_draws(tmp_path: Path) -> None:
    figures = [sample(kind) for kind in FIGURES if kind is not scenarios.ReleaseFigures]
    result = cluster.summarize(figures, {}, {"release": "ServiceError: boom"}, {}, {}, {}, {})
    assert result["missing"] == ["release.total_s", "release.stage_s", "release.flow_run_host"]
    assert plots.draw("cluster", result, tmp_path / "cluster.png") is not None


@pytest.mark.skipif(not KEPT.exists(), reason="no bench/results/cluster.json kept yet")
def test_the_kept_result_carries_every_figure() -> None:
    result = json.loads(KEPT.read_text())
    assert cluster.missing(result) == [] and not result["errors"], result.get("errors")
