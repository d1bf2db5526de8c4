"""Every benchmark's picture draws from the results the project keeps (bench/results/), and an
aim reads the way its figure improves."""

import json
from pathlib import Path

import pytest

from bench import plots

RESULTS = sorted((Path(__file__).resolve().parents[2] / "bench" / "results").glob("*.json"))


@pytest.mark.parametrize("result", RESULTS, ids=lambda path: path.stem)
def test_each_kept_result_draws_its_picture(result: Path, tmp_path: Path) -> None:
    png = plots.draw(
        result.stem.partition("-")[0], json.loads(result.read_text()), tmp_path / "p.png"
    )
    assert png is not None and png.read_bytes().startswith(b"\x89PNG")


def test_every_benchmark_has_a_picture() -> None:
    scripts = Path(plots.__file__).parent.glob("*.py")  # a benchmark has the harness's command line
    benchmarks = {p.stem for p in scripts if "harness.command_line(" in p.read_text()}
    assert benchmarks == set(plots.DRAWINGS)


def test_an_aim_is_met_on_its_own_side() -> None:
    latency = plots.Aim("p50", "p50_s", 50, "ms", scale=1e3)
    assert latency.value({"p50_s": 0.04}) == pytest.approx(40)
    assert latency.met(40) and not latency.met(60)
    ratio = plots.Aim("mixed / base", "ratio", 0.95, "x", higher_is_better=True)
    assert ratio.met(0.96) and not ratio.met(0.9)
    assert ratio.value({}) is None
