"""The fleet as text, by base: every worker, and every revision with its aliases, stage and
readiness on each worker of its base (what `mint status` and the demo print), and the table
and stage-time formats they share.

Importing this module is cheap: the registry's client (MLflow) and the workers' (httpx) are
imported when rows are asked for, so `mint --help` does not wait for them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from mint_core.errors import MintError

if TYPE_CHECKING:
    from mint_core.config import MintConfig
    from serving.client import WorkerClient


def status_rows(config: MintConfig) -> list[list[str]]:
    """A header row, then one row per revision, grouped by base: base, adapter, revision,
    aliases, stage, and readiness on each worker of that base ("no worker" when none answers
    for it)."""
    from mint_core.registry import Registry

    registry = Registry(config.tracking_uri)
    by_base = _workers_by_base(config)
    rows = []
    for adapter in registry.adapters():
        for revision in registry.revisions(adapter):
            states = []
            for worker in by_base.get(revision.policy.base_digest, []):
                try:
                    states.append(worker.readiness(revision.id)[0].value)
                except MintError:
                    states.append("unreachable")
            rows.append(
                [
                    revision.policy.base_model_id,
                    adapter,
                    f"r{revision.id.number}",
                    ",".join(revision.aliases) or "-",
                    revision.stage.value,
                    " ".join(states) or "no worker",
                ]
            )
    rows.sort(key=lambda row: row[0])  # stable: adapters and revisions keep their order
    return [["base", "adapter", "revision", "aliases", "stage", "readiness"], *rows]


def worker_rows(config: MintConfig) -> list[list[str]]:
    """A header row, then one row per worker, grouped by base: base, worker, backend, status."""
    from serving.client import WorkerClient

    rows = []
    for url in config.worker_urls:
        try:
            health = WorkerClient(url, config.worker_api_key).health()
            rows.append(
                [str(health["base_model"]), url, str(health["backend"]), str(health["status"])]
            )
        except MintError:
            rows.append(["?", url, "?", "unreachable"])
    return [["base", "worker", "backend", "status"], *sorted(rows)]


def _workers_by_base(config: MintConfig) -> dict[str, list[WorkerClient]]:
    """The workers that answer, by the digest of the base they serve."""
    from serving.client import WorkerClient

    by_base: dict[str, list[WorkerClient]] = {}
    for url in config.worker_urls:
        worker = WorkerClient(url, config.worker_api_key)
        try:
            digest = str(worker.health()["base_digest"])
        except MintError:
            continue
        by_base.setdefault(digest, []).append(worker)
    return by_base


def format_table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows
    )


def format_stage_times(seconds: Mapping[str, float]) -> str:
    return "  ".join(f"{stage} {s:.2f}s" for stage, s in seconds.items())
