"""Packing benchmark: load the reference MoE LoRA from four layouts, side by side in one run.

(a) one safetensors file per tensor (37,248 files), (b) one PEFT `adapter_model.safetensors`,
(c) MinT's packed form, to tensors ready for the engine, and (d) a raw read of the packed bytes:
the limit for this disk. Each warm (page cache) and cold (pages evicted with
posix_fadvise(DONTNEED) before each run), several runs each; medians and ratios are printed and
written to bench/results/packing.json.

    .venv/bin/python bench/packing.py             # the full reference case (~110 MB)
    .venv/bin/python bench/packing.py --scale 0.1 # a smaller case with the same structure
"""

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import harness
from bench.synthetic import QWEN3_30B_A3B, moe_adapter_config, moe_lora_tensors
from mint_core.artifacts.freezing import PEFT_WEIGHTS
from mint_core.artifacts.packing import (
    DEFAULT_SHARD_BYTES,
    PackedIndex,
    load,
    pack_tensors,
    read_into,
)


def load_files(paths: list[Path]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in paths:
        tensors.update(load_file(path))
    return tensors


def raw_read(folder: Path, index: PackedIndex, threads: int) -> int:
    """Read every shard's bytes into memory, nothing else: what the disk allows."""

    def read(name: str) -> int:
        path = folder / name
        buffer = torch.empty(path.stat().st_size, dtype=torch.uint8)
        read_into(path, buffer)
        return buffer.numel()

    names = [shard.name for shard in index.shards]
    with ThreadPoolExecutor(max(1, min(threads, len(names)))) as pool:
        return sum(pool.map(read, names))


def measure(run: Callable[[], object], files: list[Path], runs: int, cold: bool) -> list[float]:
    run()  # warms the page cache (and the code paths) before warm runs
    return harness.repeated(run, runs, before=(lambda: harness.evict(files)) if cold else None)


def main() -> None:
    parser = harness.command_line(__doc__, "packing")
    parser.add_argument("--scale", type=float, default=1.0, help="scale layers and experts")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per layout and mode")
    parser.add_argument("--shard-mb", type=int, default=DEFAULT_SHARD_BYTES >> 20)
    parser.add_argument("--workdir", type=Path, default=None, help="where to write the layouts")
    args = parser.parse_args()
    with harness.scratch("packing", args.workdir) as (workdir, _):
        run(args, workdir)


def run(args: argparse.Namespace, workdir: Path) -> None:
    shape = QWEN3_30B_A3B if args.scale == 1.0 else QWEN3_30B_A3B.scaled(args.scale)
    threads = os.cpu_count() or 1
    print(f"reference adapter: {shape.layers} layers x {shape.experts} experts, rank {shape.rank}, "
          f"{shape.tensor_count} tensors; writing layouts under {workdir}")  # fmt: skip
    tensors = moe_lora_tensors(shape)
    config = moe_adapter_config(shape)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())

    files_dir = workdir / "files"
    files_dir.mkdir()
    file_paths = []
    for number, (key, tensor) in enumerate(tensors.items()):
        path = files_dir / f"t{number:06d}.safetensors"
        save_file({key: tensor}, path)
        file_paths.append(path)
    peft_path = workdir / "peft" / PEFT_WEIGHTS
    peft_path.parent.mkdir()
    save_file(tensors, peft_path, metadata={"format": "pt"})
    packed_dir = workdir / "packed"
    index = pack_tensors(config, tensors, packed_dir, shard_bytes=args.shard_mb << 20)
    packed_paths = [packed_dir / "index.json"] + [packed_dir / s.name for s in index.shards]
    os.sync()

    cases: dict[str, tuple[Callable[[], object], list[Path]]] = {
        "files": (lambda: load_files(file_paths), file_paths),
        "peft": (lambda: load_file(peft_path), [peft_path]),
        "packed": (lambda: load(packed_dir, threads=threads), packed_paths),
        "raw": (lambda: raw_read(packed_dir, index, threads), packed_paths),
    }
    medians: dict[str, float] = {}
    samples: dict[str, list[float]] = {}
    for mode in ("warm", "cold"):
        for name, (load_case, paths) in cases.items():
            times = measure(load_case, paths, args.runs, cold=mode == "cold")
            samples[f"{name}_{mode}"] = times
            medians[f"{name}_{mode}"] = statistics.median(times)
            print(f"  {name:<7} {mode}: median {medians[f'{name}_{mode}'] * 1e3:8.1f} ms "
                  f"({nbytes / medians[f'{name}_{mode}'] / 1e9:5.2f} GB/s)")  # fmt: skip

    ratios = {}
    for mode in ("warm", "cold"):
        ratios[f"files_over_packed_{mode}"] = medians[f"files_{mode}"] / medians[f"packed_{mode}"]
        ratios[f"peft_over_packed_{mode}"] = medians[f"peft_{mode}"] / medians[f"packed_{mode}"]
        ratios[f"packed_over_raw_{mode}"] = medians[f"packed_{mode}"] / medians[f"raw_{mode}"]
    print(f"\n{len(index.shards)} packed shards of at most {args.shard_mb} MiB; "
          f"{nbytes / 1e6:.1f} MB of tensors")  # fmt: skip
    for name, value in ratios.items():
        print(f"  {name:<24} {value:6.2f}x")

    result = {
        "shape": {k: v for k, v in vars(shape).items() if k != "dtype"}
        | {"dtype": str(shape.dtype)},
        "tensors": shape.tensor_count,
        "tensor_bytes": nbytes,
        "packed_shards": len(index.shards),
        "shard_bytes": args.shard_mb << 20,
        "threads": threads,
        "runs": args.runs,
        "median_s": medians,
        "samples_s": samples,
        **ratios,
    }
    harness.write(args.out, result)


if __name__ == "__main__":
    main()
