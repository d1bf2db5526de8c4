"""What workers follow: the adapters changed since a time, each with its aliases, canary share
and the pipeline's alias intents, a page at a time."""

from collections.abc import Mapping
from dataclasses import dataclass, field

from mint_core.alias_intents import AliasIntent, HeldMove, intents_of, sanctioned
from mint_core.gates import replicas_of
from mint_core.registry._mlflow import ADAPTER_KIND, BASE_DIGEST_TAG, KIND_TAG, MlflowStore
from mint_core.registry.canary import canary_percent

MODELS_PAGE_MAX = 1000
"""The most registered models MLflow's server returns per page (its `search_registered_models`
refuses more)."""
FIRST_PAGE = 2
"""Registered models in a sync's first page. A sync with nothing new stops at the first model
older than its cursor, and one with one change (read again within the cursor's overlap) at the
second: one request either way. MLflow's server loads each model it returns with its tags,
aliases and latest versions, and every worker syncs every interval, so the page is kept small:
over 40 adapters of 3 versions, an idle sync cost the server a median 21.9 ms of CPU at 20 a
page and 15.5 ms at 2 (200 syncs a size, three rounds, 2 cores)."""


@dataclass(frozen=True)
class AdapterAliases:
    """An adapter's aliases as of its last change in the registry."""

    adapter: str
    aliases: Mapping[str, int]
    """Alias -> revision number."""
    updated_ms: int
    """The registry's last-updated time of the adapter, in milliseconds (its clock)."""
    base_digest: str = ""
    """The base every revision of the adapter was trained on."""
    canary_percent: float | None = None
    """The share of `production`'s requests sent to the `canary` revision; None: no canary."""
    intents: Mapping[str, AliasIntent] = field(default_factory=dict)
    """Alias -> the pipeline's last move of it."""
    replicas: int = 0
    """Workers that hold each of its revisions, as its gates say; 0: the fleet's setting."""

    def sanctioned(self) -> tuple[dict[str, int], list[HeldMove]]:
        """The aliases workers serve (those the pipeline moved) and the held moves."""
        return sanctioned(self.adapter, self.aliases, self.intents)


@dataclass(frozen=True)
class Changes:
    """Reading what changed in the registry, for workers' syncs."""

    store: MlflowStore

    def since(self, since_ms: int, page_size: int = FIRST_PAGE) -> list[AdapterAliases]:
        """Every adapter updated (new revision, alias moved) at or after `since_ms` on the
        registry's clock, newest first: what a worker needs to catch up. The first page is
        small, as a sync usually finds a few changes at most; each next one is larger, up to
        MLflow's largest, so reading every adapter takes few requests. RegistryError if MLflow
        cannot answer."""
        changed: list[AdapterAliases] = []
        page_token = None
        with self.store.failing("list adapters"):
            while True:
                page = self.store.client.search_registered_models(
                    max_results=page_size,
                    order_by=["last_updated_timestamp DESC"],
                    page_token=page_token,
                )
                for model in page:
                    if model.last_updated_timestamp < since_ms:
                        return changed
                    if model.tags.get(KIND_TAG) == ADAPTER_KIND:
                        changed.append(
                            AdapterAliases(
                                model.name,
                                {a: int(v) for a, v in (model.aliases or {}).items()},
                                model.last_updated_timestamp,
                                model.tags.get(BASE_DIGEST_TAG, ""),
                                canary_percent(model),
                                intents_of(model.tags),
                                replicas_of(model.tags),
                            )
                        )
                page_token = page.token
                if not page_token:
                    return changed
                # Page tokens are offsets, so the size may change from page to page.
                page_size = min(page_size * 10, MODELS_PAGE_MAX)
