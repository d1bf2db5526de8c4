"""What both cookbook drivers share: the offline set-up, the generic renderer, and the report
each prints of its run (read from the log folder the cookbook writes)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

# No network but the server: tokenizers load from the folder, data from local files.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TINKER_TELEMETRY", "0")

RENDERER = "role_colon"


def no_pricing_download() -> None:
    """The loops fetch a price list from tinker-docs.thinkingmachines.ai once per process
    (`fetch_model_pricing`, only for cost metrics); mark it as already tried, which is what a
    failed fetch leaves: token counts are logged without USD."""
    from tinker_cookbook.utils import cost_estimation

    cost_estimation._pricing_fetched = True


def report(log_path: Path, loop: str, step_metric: str) -> dict:
    """The steps trained (rows of metrics.jsonl with `step_metric`) and the checkpoints saved."""

    def rows(name: str) -> list[dict]:
        path = log_path / name
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    checkpoints = rows("checkpoints.jsonl")
    final = next((c for c in reversed(checkpoints) if c.get("name") == "final"), None)
    return {
        "loop": loop,
        "log_path": str(log_path),
        "steps": sum(step_metric in row for row in rows("metrics.jsonl")),
        "checkpoints": checkpoints,
        "final_state_path": final and final.get("state_path"),
        "final_sampler_path": final and final.get("sampler_path"),
    }


def arguments(doc: str) -> argparse.Namespace:
    """A driver's command line: the model folder, the output folder and the run's size."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("model", type=Path, help="local model folder (tokenizer and model name)")
    parser.add_argument("out", type=Path, help="folder for the run's logs")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--build-only", action="store_true", help="build the data; no server")
    return parser.parse_args()
