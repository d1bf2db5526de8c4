"""Starting a worker: in this process (`serve`) or as a child process (`start_worker`)."""

import logging
import threading
from collections.abc import Mapping
from functools import partial

from transformers.utils import logging as transformers_logging

from mint_core.artifacts.stores import open_store
from mint_core.catalog.catalog import Catalog
from mint_core.config import LOOPBACK, WORKER_PORT, BackendKind, MintConfig
from mint_core.exposure import advertised_url
from mint_core.membership import open_roster
from mint_core.model.base import load_base, load_text
from mint_core.registry import Registry
from mint_core.registry_outages import notice_registry_outages_quickly
from mint_core.tenancy import TenancyFile
from processes import ManagedProcess, start_mint
from serving.backends.embedded import EmbeddedBackend
from serving.backends.protocol import Backend
from serving.engine.engine import TorchEngine
from serving.http.app import create_app
from serving.http.server import serve_http
from serving.worker.announce import announcer_for
from serving.worker.leaving import Drain, DrainPlan, Verdict
from serving.worker.peers import Peers
from serving.worker.worker import Worker

log = logging.getLogger(__name__)

CLOSED_WAIT_S = 5.0
"""Once its listener has closed, how long a worker still waits for requests it has (one that
arrived as it closed; past the drain timeout, those left) before it cancels them."""
STOP_MARGIN_S = 15.0
"""Beyond its drain timeout, what a worker told to stop may take (its notice to the gateways,
closing the engine) before `ManagedProcess.stop` kills it."""


def build_backend(config: MintConfig, tenancy: TenancyFile | None = None) -> Backend:
    """The engine `config.backend` names, serving `config.base`, sharing a busy batch among
    principals by `tenancy`'s weights (none: equally)."""
    host_cache_bytes = config.host_cache_mb << 20
    weight = (tenancy or TenancyFile(None)).weight
    if config.backend is BackendKind.VLLM:
        from serving.backends.vllm import VllmBackend, VllmSettings

        text = load_text(config.base, config.home)
        return VllmBackend(text, VllmSettings.from_config(config), host_cache_bytes, weight)
    engine = TorchEngine(load_base(config.base, config.home), slots=config.device_slots)
    return EmbeddedBackend(engine, host_cache_bytes, config.max_batch, config.host_adapters, weight)


def build_worker(config: MintConfig, me: str = "", tenancy: TenancyFile | None = None) -> Worker:
    """A worker that starts from the catalog snapshot in the artifact store, if there is one,
    and syncs with the registry at once (admitting what is placed on it). `me`: its URL as
    MINT_WORKER_URLS names it (MINT_WORKER_URL, else the address it serves on); `tenancy`:
    the principals' weights in its batch."""
    backend = build_backend(config, tenancy)
    me = config.worker_url or me
    peers = Peers(me, open_roster(config), backend.text.digest, config.worker_api_key)
    store = open_store(config)
    catalog = Catalog(
        Registry(config.tracking_uri),
        config.pins,
        backend.text.digest,
        config.home / "catalog",
        config.alias_audit_interval_s,
    )
    catalog.start_from_snapshot(store)
    return Worker(
        backend,
        catalog,
        store,
        admission_k=config.admission_k,
        sync_interval_s=config.sync_interval_s,
        peers=peers,
        replicas=config.replicas,
        announcer=announcer_for(config, me, backend.text.digest),
    ).start()


def serve(config: MintConfig, host: str = LOOPBACK, port: int = WORKER_PORT) -> None:
    """Load the base, follow the registry, serve until stopped: a worker process's life,
    however it is started (`mint serve`, by hand or from `start_worker`)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    notice_registry_outages_quickly()
    transformers_logging.disable_progress_bar()
    # Its name in placement: the URL every other host reaches it at (MINT_WORKER_URL, needed on
    # a wildcard bind), so that all of them place revisions alike.
    me = advertised_url(host, port, config.worker_url, config.tls.enabled)
    tenancy = TenancyFile(config.tenancy_file, config.tenancy_shares)
    worker = build_worker(config, me, tenancy)
    drain = Drain(DrainPlan.of(config.sync_interval_s, config.drain_timeout_s))
    app = create_app(worker, config.api_keys, config.admin_principals, tenancy=tenancy, drain=drain)
    try:
        serve_http(
            app, host, port, config.http_bounds, config.tls, partial(leave, worker, drain),
            stop_timeout_s=min(config.drain_timeout_s, CLOSED_WAIT_S),
        )  # fmt: skip
    finally:
        worker.close()  # a vLLM backend's server runs in a process group of its own


def leave(worker: Worker, drain: Drain) -> None:
    """Leave the fleet without failing a request (`serving.worker.leaving`): say so, keep
    serving until nobody sends and nothing is in flight (or the drain timeout), then return."""
    drain.leave()
    log.info("told to stop: leaving the fleet, finishing %d requests", drain.in_flight)
    # Its own thread: a registry slow to answer must not hold the drain (gateways read
    # `/admin/routing` anyway).
    threading.Thread(target=worker.leave, name="leave", daemon=True).start()
    if drain.wait() is Verdict.TIMED_OUT:
        log.warning(
            "still had %d requests after MINT_DRAIN_TIMEOUT_MS (%g s): stopping with them",
            drain.in_flight,
            drain.plan.timeout_s,
        )


def start_worker(
    config: MintConfig,
    port: int | None = None,
    timeout_s: float = 300.0,
    env: Mapping[str, str] | None = None,
    host: str = LOOPBACK,
) -> ManagedProcess:
    """A worker in a child process on `host` (default loopback); returns once `/health`
    answers (base loaded). `env`: more of its environment (e.g. the registry account it reads
    with); its URL is `config.worker_url` if set (MINT_WORKER_URL: what other hosts use)."""
    service = start_mint(
        "serve", "serving worker", "worker", config, port, timeout_s, env, host, config.worker_url
    )
    service.grace_s = config.drain_timeout_s + STOP_MARGIN_S  # stopping waits for its drain
    return service
