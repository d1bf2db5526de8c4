"""The fleet as text, by base: every worker, and every revision with its aliases, stage and
readiness on each worker of its base (what `mint status` and the demo print), and the table
and stage-time formats they share.

Importing this module is cheap: the registry's client (MLflow) and the workers' (httpx) are
imported when rows are asked for, so `mint --help` does not wait for them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from mint_core.errors import MintError, ServiceError

if TYPE_CHECKING:
    from mint_core.config import MintConfig
    from mint_core.usage import UsageRow
    from serving.http.client import WorkerClient


Health = list[tuple["WorkerClient", dict[str, object] | None]]
"""Each worker with its `/health`, None for one that does not answer."""


def fleet_health(config: MintConfig) -> Health:
    """Every worker's `/health`, asked once for both tables: the fleet's workers
    (MINT_WORKER_URLS, and with MINT_FLEET=registry those announcing themselves)."""
    from mint_core.membership import FleetSource, current_fleet
    from serving.http.client import WorkerClient

    fleet: Health = []
    static = config.fleet.source is FleetSource.STATIC
    # A static fleet in MINT_WORKER_URLS' order, as the tables always listed it.
    for url in config.worker_urls if static else current_fleet(config):
        worker = WorkerClient(url, config.worker_api_key)
        try:
            fleet.append((worker, worker.health()))
        except MintError:
            fleet.append((worker, None))
    return fleet


def fleet_usage(
    config: MintConfig, since: float, fleet: Health | None = None
) -> tuple[list[UsageRow], float, list[str]]:
    """Every answering worker's usage from `since` on, added up per principal and revision;
    from when all of them still knew it; and the workers that did not answer (their usage is
    missing from the rows). ServiceError if none answered."""
    from mint_core.usage import merge

    rows: list[UsageRow] = []
    kept_since = since
    missing = []
    fleet = fleet if fleet is not None else fleet_health(config)
    for worker, health in fleet:
        try:
            if health is None:
                raise MintError("no /health")
            theirs, kept = worker.usage(since)
        except MintError:
            missing.append(worker.url)
            continue
        rows += theirs
        kept_since = max(kept_since, kept)
    if len(missing) == len(fleet):
        raise ServiceError(
            f"no worker of the fleet answered ({', '.join(missing) or 'none is known'}); start "
            "them (`mint serve`), or point MINT_WORKER_URLS at them"
        )
    return merge(rows), kept_since, missing


def status_rows(config: MintConfig, fleet: Health | None = None) -> list[list[str]]:
    """A header row, then one row per revision, grouped by base: base, adapter, revision,
    aliases, stage, and readiness on each worker of that base ("no worker" when none answers
    for it)."""
    from mint_core.registry import Registry

    by_base: dict[str, list[WorkerClient]] = {}
    for worker, health in fleet if fleet is not None else fleet_health(config):
        if health is not None:
            by_base.setdefault(str(health["base_digest"]), []).append(worker)
    registry = Registry(config.tracking_uri)
    rows = []
    for adapter in registry.revisions.adapters():
        for revision in registry.revisions.of(adapter):
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


def worker_rows(config: MintConfig, fleet: Health | None = None) -> list[list[str]]:
    """A header row, then one row per worker, grouped by base: base, worker, backend, its host
    and device tiers (held/bound, hits, misses, evictions since it started), status."""
    rows = []
    for worker, health in fleet if fleet is not None else fleet_health(config):
        if health is None:
            rows.append(["?", worker.url, "?", "?", "?", "unreachable"])
        else:
            status = str(health["status"])
            held = health.get("held_alias_moves")
            for move in held if isinstance(held, list) else []:
                status += f"; HELD {_held(move)}"
            tiers = health.get("tiers")
            host, device = (_tier(tiers.get(t)) if isinstance(tiers, dict) else "?"
                            for t in ("host", "device"))  # fmt: skip
            rows.append([str(health["base_model"]), worker.url, str(health["backend"]), host,
                         device, status])  # fmt: skip
    return [["base", "worker", "backend", "host tier", "device tier", "status"], *sorted(rows)]


def _tier(tier: object) -> str:
    """One residency tier as `mint status` shows it: `7/8 hits 120 misses 3 evictions 2`."""
    if not isinstance(tier, Mapping):
        return "?"
    bound = tier.get("capacity")
    held = f"{tier['revisions']}/{bound}" if bound is not None else str(tier["revisions"])
    return f"{held} hits {tier['hits']} misses {tier['misses']} evictions {tier['evictions']}"


def _held(move: Mapping[str, object]) -> str:
    """A held alias move as `mint status` shows it: where the registry points the alias, and
    what the worker serves until the pipeline moves it."""
    there, kept = move["registry_revision"], move["serving_revision"]
    return (
        f"{move['adapter']}@{move['alias']} -> {f'r{there}' if there else 'nothing'} outside "
        f"the pipeline, serving {f'r{kept}' if kept else 'nothing'}"
    )


def format_table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows
    )


def format_stage_times(seconds: Mapping[str, float]) -> str:
    return "  ".join(f"{stage} {s:.2f}s" for stage, s in seconds.items())
