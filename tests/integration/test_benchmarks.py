"""The benchmarks run and write their results (smoke runs at a small scale; figures come from
full runs, see bench/). Each result must agree with its own raw timings, and hold the one
claim a small scale still shows."""

import json
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from processes import group_running

ROOT = Path(__file__).resolve().parents[2]


def run_bench(script: str, *args: str, out: Path) -> dict[str, Any]:
    """Run bench/`script` with `args`; the results it wrote to `out` (its picture next to it)."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args, "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG"), run.stdout[-2000:]
    return json.loads(out.read_text())


def test_packing_benchmark_writes_its_ratios(tmp_path: Path) -> None:
    result = run_bench(
        "packing.py", "--scale", "0.05", "--runs", "1", "--workdir", str(tmp_path),
        out=tmp_path / "packing.json",
    )  # fmt: skip
    assert result["tensors"] == result["shape"]["layers"] * (result["shape"]["experts"] * 6 + 8)
    samples, medians = result["samples_s"], result["median_s"]
    cases = {f"{layout}_{mode}" for layout in ("files", "peft", "packed", "raw")
             for mode in ("warm", "cold")}  # fmt: skip
    assert samples.keys() == medians.keys() == cases
    for case, times in samples.items():
        assert len(times) == result["runs"] == 1
        assert medians[case] == statistics.median(times)
    for mode in ("warm", "cold"):
        for ratio, (over, under) in {
            f"files_over_packed_{mode}": ("files", "packed"),
            f"peft_over_packed_{mode}": ("peft", "packed"),
            f"packed_over_raw_{mode}": ("packed", "raw"),
        }.items():
            assert result[ratio] == pytest.approx(
                medians[f"{over}_{mode}"] / medians[f"{under}_{mode}"]
            )
    # From the page cache, one file per tensor costs an open and a header per tensor, a few
    # shards do not (cold reads, from disk at this small scale, are too noisy to compare).
    assert result["files_over_packed_warm"] > 2, result


def test_register_benchmark_writes_its_percentiles(tmp_path: Path) -> None:
    result = run_bench(
        "register.py", "--revisions", "4", "--adapters", "2", out=tmp_path / "register.json"
    )
    samples = result["samples_s"]
    assert result["revisions"] == len(samples) == 4
    assert result["register_p50_s"] == statistics.median(samples)
    assert result["register_p95_s"] == statistics.quantiles(samples, n=20)[-1]
    assert result["register_p50_s"] <= result["register_p95_s"]
    assert result["reference_over_p50"] == pytest.approx(
        result["reference_s"] / result["register_p50_s"]
    )


def test_batching_benchmark_writes_its_ratios_and_modes_agree(tmp_path: Path) -> None:
    result = run_bench(
        "batching.py", "--scale", "0.0625", "--adapters", "4", "--runs", "1",
        out=tmp_path / "batching.json",
    )  # fmt: skip
    # MinT's mixed batch and both PEFT ways give the same tokens for the same requests.
    assert result["same_tokens"] == {"peft_switching": True, "peft_mixed": True}
    tokens = result["adapters"] * result["new_tokens"]  # one request per adapter
    rates = result["tokens_per_s"]
    for mode, times in result["samples_s"].items():
        assert len(times) == result["runs"] == 1
        assert rates[mode] == pytest.approx(tokens / statistics.median(times))
    for ratio, (over, under) in {
        "mixed_over_base": ("mixed", "base"),
        "mixed_over_peft_switching": ("mixed", "peft_switching"),
        "mixed_over_peft_mixed": ("mixed", "peft_mixed"),
    }.items():
        assert result[ratio] == pytest.approx(rates[over] / rates[under])
    # Whether one batch for four adapters beats four batches of one is the benchmark's figure
    # (bench/results/batching.json), not a test's: at this scale, on a loaded CI machine, the
    # ratio is noise around 1.


@pytest.mark.slow
def test_sync_benchmark_times_both_paths_to_an_answer(tmp_path: Path) -> None:
    result = run_bench("sync.py", "--layers", "1", "--runs", "1", out=tmp_path / "sync.json")
    assert result["model"]["layers"] == 1
    assert list(result["stages_s"]["adapter"]) == [
        "freeze", "pack", "export", "register", "admit", "fetch_prewarm", "answer"
    ]  # fmt: skip
    assert list(result["stages_s"]["merged"]) == ["merge", "save", "start_load", "answer"]
    for path in ("adapter", "merged"):
        (total,) = result["samples_s"][path]
        (stages,) = result["stage_samples_s"][path]
        assert result[f"{path}_s"] == total == pytest.approx(sum(stages.values()))
    assert result["speedup"] == pytest.approx(result["merged_s"] / result["adapter_s"])
    assert result["bytes_ratio"] == pytest.approx(result["merged_bytes"] / result["adapter_bytes"])
    # Both paths serve the same adapter: the same greedy tokens, which are not the base's.
    (answers,) = result["answers"]
    assert answers["adapter"] == answers["merged"] != result["base_tokens"]
    # Even one layer deep, the rank-16 pairs are a sliver of the merged weights (the embedding
    # alone is 151,936 x 1,024), and the merged path starts a process to serve them.
    assert result["merged_bytes"] > 20 * result["adapter_bytes"]
    assert result["speedup"] > 1, result


@pytest.mark.slow
def test_rl_sync_benchmark_times_adapter_and_full_weights(tmp_path: Path) -> None:
    result = run_bench(
        "rl_sync.py", "--layers", "1", "--experts", "4", "--vocab", "4096", "--runs", "1",
        out=tmp_path / "rl_sync.json",
    )  # fmt: skip
    assert (result["shape"]["layers"], result["shape"]["experts"]) == (1, 4)
    assert result["adapter"]["target_parameters"] == [
        "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
    ]  # fmt: skip
    for path in ("adapter", "full"):
        (total,) = result["samples_s"][path]
        (stages,) = result["stage_samples_s"][path]
        assert result[f"{path}_s"] == total == pytest.approx(sum(stages.values()))
        assert result["floor_s"][path] == pytest.approx(
            result[f"{path}_bytes"] / result["disk_read_bytes_per_s"]["cold"]
        )
    assert result["speedup"] == pytest.approx(result["full_s"] / result["adapter_s"])
    assert result["bytes_ratio"] == pytest.approx(result["full_bytes"] / result["adapter_bytes"])
    # Both paths serve the same expert LoRA: the same greedy tokens, which are not the base's.
    (answers,) = result["answers"]
    assert answers["adapter"] == answers["full"] != result["base_tokens"]
    # One rank-1 pair per expert projection against the experts' full matrices.
    assert result["full_bytes"] > 100 * result["adapter_bytes"], result


def test_catalog_benchmark_writes_its_figures(tmp_path: Path) -> None:
    result = run_bench(
        "catalog.py", "--adapters", "200", "--bases", "50", "--lookups", "500",
        "--mlflow-adapters", "4", "--mlflow-revisions", "3", "--moves", "2",
        out=tmp_path / "catalog.json",
    )  # fmt: skip
    assert result["revisions"] == 2000
    # Base 0 holds adapters 0, 50, 100 and 150: production and candidate (one in ten has it).
    assert result["desired_revisions"] == 8
    assert result["desired_every_base_revisions"] == 200 + 20
    assert result["mlflow_versions"] == 12
    assert result["sync_versions_per_s"] == pytest.approx(12 / result["sync_full_s"])
    samples = result["alias_visible_samples_s"]
    assert len(samples) == 2 and result["alias_visible_s"] == statistics.median(samples)
    assert result["resolve_p50_us"] <= result["resolve_p99_us"] <= result["resolve_max_us"]


def test_tiers_benchmark_serves_more_adapters_than_its_host_tiers_hold(
    tmp_path: Path, mint_home: Path
) -> None:
    result = run_bench(
        "tiers.py", "--adapters", "300", "--host-adapters", "20", "--warmup-s", "2",
        "--measure-s", "6", "--baseline-s", "2", "--home", str(mint_home),
        out=tmp_path / "tiers.json",
    )  # fmt: skip
    samples = result["samples"]
    assert result["warm_requests"] == len(samples["warm_s"])
    assert result["cold_requests"] == len(samples["cold_s"])
    assert result["hit_ratio"] == pytest.approx(
        result["warm_requests"] / (result["warm_requests"] + result["cold_requests"])
    )
    assert result["cold_requests"] > 0 and result["errors"] == 0 and result["gave_up"] == 0
    assert result["request_path_loads"] == 0
    assert 0 < result["peak_host_revisions"] <= result["host_bound"] == 20


def test_tiers_simulation_compares_with_belady_and_moves_one_nth(tmp_path: Path) -> None:
    result = run_bench(
        "tiers_sim.py", "--adapters", "20000", "--workers", "10", "--requests", "60000",
        "--moves", "5000", "--zipf", "1.0", "--half-lives", "30", out=tmp_path / "tiers_sim.json",
    )  # fmt: skip
    run = result["by_zipf"]["1.0"]
    # Belady is the offline optimum for the same sequences and capacity: nothing beats it.
    assert run["lru_hit_ratio"] <= run["belady_hit_ratio"]
    assert 0 < run["host_hit_ratio"] <= run["belady_hit_ratio"]
    assert run["mint_over_belady"] == pytest.approx(run["host_hit_ratio"] / run["belady_hit_ratio"])
    movement = result["movement"]
    assert movement["join_moves_only_to_new"] and movement["leave_moves_only_its_own"]
    assert abs(movement["moved_on_join"] - 1 / 11) < 0.03, movement
    assert abs(movement["moved_on_leave"] - 1 / 10) < 0.03, movement


def test_tenants_benchmark_compares_one_trainer_with_separate_trainings(
    tmp_path: Path, mint_home: Path
) -> None:
    result = run_bench(
        "tenants.py",
        "--tenants",
        "2",
        "--steps",
        "2",
        "--runs",
        "1",
        "--home",
        str(mint_home),
        out=tmp_path / "t.json",
    )
    cases = {(case["tenants"], case["mode"]): case for case in result["cases"]}
    assert cases.keys() == {(2, "shared"), (2, "separate")}
    for case in cases.values():
        assert case["rss_mb"] > 0 and case["tokens_per_s"] == pytest.approx(
            case["tokens"] / case["wall_s"], rel=0.01
        )
        # Both modes train the same loop from the same start.
        assert case["first_loss"] == pytest.approx(cases[2, "separate"]["first_loss"], rel=1e-3)
    # One base for both tenants, not one per tenant.
    assert cases[2, "shared"]["rss_mb"] < cases[2, "separate"]["rss_mb"]


@pytest.mark.slow
def test_rollback_benchmark_times_each_way_to_users(tmp_path: Path, mint_home: Path) -> None:
    result = run_bench(
        "rollback.py", "--rounds", "1", "--no-pool", "--home", str(mint_home),
        out=tmp_path / "rollback.json",
    )  # fmt: skip
    samples, medians = result["samples_s"], result["median_s"]
    assert set(samples) == {"alias", "cli", "ui"}
    for way, figures in samples.items():
        for key, values in figures.items():
            assert medians[way][key] == statistics.median(values)
    # One round: production r2 -> r1 -> r2 each way, one sample per direction.
    assert len(samples["cli"]["exit_s"]) == len(samples["ui"]["served_s"]) == 2
    assert result["cli_p50_s"] == medians["cli"]["exit_s"]
    assert result["ui_served_p50_s"] == medians["ui"]["served_s"]
    # A run reaches users only after it started, and its start precedes its own run's end.
    for served, start in zip(samples["ui"]["served_s"], samples["ui"]["start_s"], strict=True):
        assert 0 <= start < served
    # Moving the alias alone is a registry call; a whole rollback does more than that.
    assert result["alias_move_p50_s"] < result["cli_p50_s"]


SIGNALLED_RUN = """
import sys, time
from bench import harness
from processes import start_process

with harness.scratch("signalled") as (work, services):
    sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
    services.append(start_process("sleeper", sleep, "", lambda: True, work / "sleeper.log"))
    print(work, services[0].process.pid, flush=True)
    time.sleep(600)
"""
"""A benchmark's shape: a service started in its scratch folder, then a long measurement."""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_benchmark_stopped_by_a_signal_stops_its_services_and_removes_its_folder(
    sig: signal.Signals,
) -> None:
    run = subprocess.Popen(
        [sys.executable, "-c", SIGNALLED_RUN], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert run.stdout is not None
    work, pid = run.stdout.readline().split()
    run.send_signal(sig)
    run.wait(60)
    assert not group_running(int(pid)), f"its service (process group {pid}) still runs"
    assert not Path(work).exists()
