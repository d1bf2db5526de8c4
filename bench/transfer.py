"""Host-to-device copy bandwidth of a slot load, against the device's own, in the same run.

Where a CUDA device exists, `batching.py` and `sync.py` run their engines on it and time the
engine's slot load (`TorchEngine.load`: one adapter's staged buffer, pinned on the host, copied
into a device slot) and a plain pinned-memory copy of the same bytes; the ratio says how close a
slot load comes to what the link gives. Without a CUDA device there is nothing to measure: the
figures are None and the benchmarks stay CPU-only.
"""

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from mint_core.model.base import BaseSource, load_base
from serving.engine.engine import AdapterWeights, TorchEngine

RUNS = 10


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        default=default_device(),
        help="where the base runs: cuda (the default where a CUDA device exists) or cpu",
    )


def _median_s(
    run: Callable[[], object], before: Callable[[], object], device: torch.device
) -> float:
    """Median seconds of `run()` until the device has finished it (`before()` untimed)."""
    times = []
    for _ in range(RUNS + 1):  # the first one warms the allocator and the link up
        before()
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def slot_load_bandwidth(engine: TorchEngine, weights: AdapterWeights) -> dict[str, float] | None:
    """A slot load of `weights` (not loaded on `engine`: it is left unloaded) against a pinned
    copy of as many bytes; None where the engine is not on a CUDA device."""
    device = engine.device
    if device.type != "cuda" or weights.staged is None:
        return None
    nbytes = weights.staged.nbytes
    load_s = _median_s(lambda: engine.load(weights), lambda: engine.unload(weights.key), device)
    engine.unload(weights.key)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    copy_s = _median_s(lambda: pinned.to(device, non_blocking=True), lambda: None, device)
    figures = {
        "bytes": nbytes,
        "slot_load_s": load_s,
        "slot_load_bytes_per_s": nbytes / load_s,
        "pinned_copy_bytes_per_s": nbytes / copy_s,
        "slot_load_over_pinned_copy": copy_s / load_s,
    }
    return figures


def peft_folder_bandwidth(source: BaseSource, home: Path, adapter: Path) -> dict[str, float] | None:
    """`slot_load_bandwidth` of the PEFT adapter folder `adapter` on an engine over the base
    `source` (loaded here, on its device); None without a CUDA device."""
    if not (source.device or default_device()).startswith("cuda"):
        return None
    engine = TorchEngine(load_base(source, home), slots=1)
    config = json.loads((adapter / "adapter_config.json").read_text())
    tensors = load_file(adapter / "adapter_model.safetensors")
    return slot_load_bandwidth(engine, engine.prepare("bandwidth-probe", config, tensors))


def report(figures: dict[str, float] | None) -> None:
    if figures is None:
        print("  no CUDA device: host-to-device copy bandwidth not measured")
        return
    print(f"  slot load: {figures['bytes'] / 1e6:.1f} MB in {figures['slot_load_s'] * 1e3:.2f} ms, "
          f"{figures['slot_load_bytes_per_s'] / 1e9:.1f} GB/s; a pinned copy of as many bytes "
          f"{figures['pinned_copy_bytes_per_s'] / 1e9:.1f} GB/s "
          f"({figures['slot_load_over_pinned_copy']:.0%} of it; aim >= 80%)")  # fmt: skip
