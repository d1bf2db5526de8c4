"""Publishing the catalog snapshot workers start from."""

from prefect import task
from prefect.cache_policies import NO_CACHE

from mint_core.artifacts.stores import open_store
from mint_core.catalog.catalog import build_snapshot
from mint_core.catalog.snapshot import Snapshot
from mint_core.config import MintConfig
from mint_core.registry import Registry
from tasks.policies import transient


@task(
    name="catalog-snapshot",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=1,
    retry_condition_fn=transient,
)
def snapshot_catalog(config: MintConfig) -> Snapshot:
    """Publish the whole registry as the catalog snapshot workers start from, keeping the newest
    `config.catalog_snapshots`."""
    registry = Registry(config.tracking_uri)
    folder = config.work_root / "catalog"
    return build_snapshot(registry, open_store(config), folder, config.catalog_snapshots)
