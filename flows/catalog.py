"""Catalog snapshot: the whole registry as one index file in the artifact store, which workers
start from instead of reading every revision from MLflow (`mint_core.catalog.snapshot`). Run it
on a schedule, or after many releases; a worker syncs on from whichever snapshot it started
from, so an old one costs only a longer first sync."""

from prefect import flow

from flows.ending import ends_on_mint_error
from mint_core.config import MintConfig
from tasks.pipeline import snapshot_catalog
from tasks.runs import label_run, summarize


@flow(name="catalog-snapshot", flow_run_name="catalog snapshot")
@ends_on_mint_error
def catalog_snapshot() -> str:
    """Publish a new catalog snapshot; its digest."""
    label_run(None)
    digest = snapshot_catalog(MintConfig.from_env()).digest
    summarize("catalog", "published a catalog snapshot", {"digest": digest})
    return digest
