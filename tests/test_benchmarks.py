"""The benchmarks run and write their results (smoke runs at a small scale: no timing is
asserted here; figures come from full runs, see bench/)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_packing_benchmark_writes_its_ratios(tmp_path: Path) -> None:
    out = tmp_path / "packing.json"
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "packing.py"), "--scale", "0.05", "--runs", "1",
         "--out", str(out), "--workdir", str(tmp_path)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    result = json.loads(out.read_text())
    for key in ("files_over_packed_warm", "files_over_packed_cold", "peft_over_packed_warm",
                "packed_over_raw_warm"):  # fmt: skip
        assert result[key] > 0
    assert result["tensors"] == result["shape"]["layers"] * (result["shape"]["experts"] * 6 + 8)


def test_register_benchmark_writes_its_percentiles(tmp_path: Path) -> None:
    out = tmp_path / "register.json"
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "register.py"), "--revisions", "4", "--adapters",
         "2", "--out", str(out)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["revisions"] == 4
    assert 0 < result["register_p50_s"] <= result["register_p95_s"]


def test_batching_benchmark_writes_its_ratios_and_modes_agree(tmp_path: Path) -> None:
    out = tmp_path / "batching.json"
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "batching.py"), "--scale", "0.0625", "--adapters",
         "4", "--runs", "1", "--out", str(out)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    result = json.loads(out.read_text())
    for key in ("mixed_over_base", "mixed_over_peft_switching", "mixed_over_peft_mixed"):
        assert result[key] > 0
    # MinT's mixed batch and both PEFT ways give the same tokens for the same requests.
    assert result["same_tokens"] == {"peft_switching": True, "peft_mixed": True}
