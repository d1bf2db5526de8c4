"""The fleet as text: every revision with its aliases, stage and readiness on each worker (what
`mint status` and the demo print), and the table and stage-time formats they share.

Importing this module is cheap: the registry's client (MLflow) and the workers' (httpx) are
imported when rows are asked for, so `mint --help` does not wait for them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from mint_core.errors import MintError

if TYPE_CHECKING:
    from mint_core.config import MintConfig


def status_rows(config: MintConfig) -> list[list[str]]:
    """A header row, then one row per revision: adapter, revision, aliases, stage, readiness on
    each worker (`unreachable` for a worker that does not answer)."""
    from mint_core.registry import Registry
    from serving.client import WorkerClient

    registry = Registry(config.tracking_uri)
    workers = [WorkerClient(url, config.worker_api_key) for url in config.worker_urls]
    rows = [["adapter", "revision", "aliases", "stage", "readiness"]]
    for adapter in registry.adapters():
        for revision in registry.revisions(adapter):
            states = []
            for worker in workers:
                try:
                    state, _ = worker.readiness(revision.id)
                    states.append(state.value)
                except MintError:
                    states.append("unreachable")
            rows.append(
                [
                    adapter,
                    f"r{revision.id.number}",
                    ",".join(revision.aliases) or "-",
                    revision.stage.value,
                    " ".join(states),
                ]
            )
    return rows


def format_table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows
    )


def format_stage_times(seconds: Mapping[str, float]) -> str:
    return "  ".join(f"{stage} {s:.2f}s" for stage, s in seconds.items())
