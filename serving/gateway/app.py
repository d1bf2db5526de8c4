"""The gateway's routing state, its forwarding, and its HTTP front (`serving.gateway` says how
it routes)."""

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager

import aiohttp
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mint_core.access import principal_of_header
from mint_core.artifacts.stores import open_store
from mint_core.catalog.catalog import Catalog
from mint_core.config import GATEWAY_PORT, LOOPBACK, MintConfig
from mint_core.errors import NotFoundError, RegistryError, ServiceError
from mint_core.membership import FleetSource, Roster, open_roster
from mint_core.planning.placement import Demand
from mint_core.registry import RegisteredRevision, Registry
from mint_core.registry_outages import notice_registry_outages_quickly
from mint_core.revisions import RevisionId, RevisionRef
from mint_core.tenancy import Limiter, TenancyFile
from processes import ManagedProcess, start_mint
from serving.gateway.fleet import Fleet, WorkerView
from serving.gateway.forward import forward_to, json_answer, not_ready_revision, whole_answer
from serving.gateway.links import Links
from serving.gateway.requests import gateway_document, model_of
from serving.http.common import ADAPTER_PREFIX, BASE_NAMES, adapter_of_url
from serving.http.errors import install_error_handlers
from serving.http.limits import MAX_REQUEST_BYTES, BodyLimit
from serving.http.server import serve_http
from serving.http.wire import ASK_INTERVAL_S, ROUTING_REFRESH_S, AdmitRequest

log = logging.getLogger(__name__)

DEFAULT_REFRESH_S = ROUTING_REFRESH_S
_POLL = aiohttp.ClientTimeout(total=2.0)
"""A worker that takes longer to say what it holds counts as down until it answers again."""
CATCH_UP_S = 5.0
"""The longest a request waits for the catalog to catch up with an alias a worker has seen
move: a registry that answers takes a fraction of a second; one that does not leaves the
request its not-ready answer."""


class Gateway:
    """The routing state and the forwarding; `app()` is its HTTP front."""

    def __init__(
        self,
        worker_urls: Iterable[str],
        catalog: Catalog,
        worker_api_key: str = "",
        refresh_s: float = DEFAULT_REFRESH_S,
        sync_interval_s: float = MintConfig.sync_interval_s,
        replicas: int = MintConfig.replicas,
        hot_rate: float = MintConfig.hot_rate,
        roster: Roster | None = None,
        api_keys: Mapping[str, str] | None = None,
        tenancy: TenancyFile | None = None,
    ) -> None:
        """`roster`: where the fleet is read as it changes (MINT_FLEET=registry); without one
        it is `worker_urls`, fixed. `api_keys` and `tenancy`: who calls, and the principals'
        quotas this gateway enforces (its share of them)."""
        self.fleet = Fleet([WorkerView(url.rstrip("/")) for url in worker_urls])
        self.catalog = catalog
        self.replicas = replicas
        """Workers that hold each revision, unless its adapter's gates say otherwise."""
        self.demand = Demand(hot_rate, clock=time.monotonic)
        """Each revision's recent requests through this gateway: hot ones get more replicas."""
        self._asked: dict[tuple[str, str], float] = {}
        """(worker, revision) -> when the worker was last asked to admit it."""
        self._asking: set[asyncio.Task[None]] = set()
        """Those asks under way (the loop keeps only weak references to tasks)."""
        self.refresh_s = refresh_s
        self.sync_interval_s = sync_interval_s
        self._admin_headers = (
            {"Authorization": f"Bearer {worker_api_key}"} if worker_api_key else {}
        )
        self.roster = roster
        self.api_keys = api_keys or {}
        self.limiter = Limiter((tenancy or TenancyFile(None)).current)
        """Requests per second and at once; the tokens are the workers' to count (a gateway
        tokenizes nothing), so a token quota is enforced where the request is served."""
        self.links = Links()
        self._closed = threading.Event()
        self._nudge = threading.Event()
        """Set: the sync loop syncs now rather than at its next interval."""
        self._syncs = threading.Condition()
        self._syncs_started = 0
        self._syncs_done = 0
        """Syncs the loop started and finished: a caller waits for one that started after it
        asked (`synced`)."""
        self._document: dict[str, object] | None = None
        """The OpenAPI document, once a worker has described the routes it forwards."""

    # Keeping the copies fresh.

    async def refresh(self) -> None:
        """Read every worker's routing state once; a worker that does not answer is down. One
        that does not answer in time or take a connection, and sent nothing meanwhile, has its
        link cut: its requests end at once (`serving.gateway.links`). Not one that said it was
        leaving and now refuses connections: it closed its listener, and what it still has
        finishes on the connections it keeps (`serving.worker.leaving`)."""

        async def one(view: WorkerView) -> None:
            asked_at = time.monotonic()
            link = self.links.of(view.url)
            try:
                async with link.session.get(
                    view.url + "/admin/routing", headers=self._admin_headers, timeout=_POLL
                ) as answer:
                    answer.raise_for_status()
                    view.update(await answer.json())
                    link.heard()
            except (aiohttp.ClientConnectorError, TimeoutError) as e:
                # No answer, or no connection: cut off (a reset or a close is an answer: its
                # requests have failed already, or are still going).
                view.down(f"unreachable: {type(e).__name__}: {e}")
                if view.leaving and isinstance(e, aiohttp.ClientConnectorError):
                    return  # it closed its listener as it left: its requests go on
                why = f"the gateway could not reach it: {type(e).__name__}"
                if await self.links.cut_if_silent(view.url, link, asked_at, why):
                    log.warning("%s is unreachable; its requests were ended: %s", view.url, e)
            except (aiohttp.ClientError, ValueError, KeyError) as e:
                view.down(f"{type(e).__name__}: {e}")

        await asyncio.gather(*(one(view) for view in self.fleet.workers + self.fleet.leaving))
        for view in self.fleet.drained():
            await self.links.cut(view.url, "it left the fleet")

    async def _refresh_loop(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.refresh_s)

    async def follow_roster(self) -> None:
        """Read the roster once and make the fleet its members (`Fleet.reconcile`)."""
        if self.roster is None:
            return
        await asyncio.to_thread(self.roster.refresh)
        change = self.fleet.reconcile(self.roster.fleet())
        for view in change.joined:
            log.info("%s joined the fleet", view.url)
        for view in change.left:
            view.down("it left the fleet")
            log.info("%s left the fleet, with %d requests in flight", view.url, view.in_flight)
            if view not in self.fleet.leaving:
                await self.links.cut(view.url, "it left the fleet")

    async def _roster_loop(self) -> None:
        while True:
            try:
                await self.follow_roster()
            except Exception:  # the loop must outlive any one bad read
                log.exception("reading the fleet's roster failed")
            await asyncio.sleep(self.sync_interval_s)

    def sync_catalog(self) -> None:
        """Catch the catalog up with the registry once."""
        try:
            self.catalog.sync()
        except RegistryError:
            pass  # the catalog keeps what it had and says why (`unreachable`)
        except Exception:  # the loop must outlive any one bad sync
            log.exception("sync with the registry failed")

    def _sync_loop(self) -> None:
        while not self._closed.is_set():
            with self._syncs:
                self._syncs_started += 1
                started = self._syncs_started
            self.sync_catalog()
            with self._syncs:
                self._syncs_done = started
                self._syncs.notify_all()
            self._nudge.wait(self.sync_interval_s)
            self._nudge.clear()

    def synced(self, timeout_s: float = CATCH_UP_S) -> None:
        """Return once a sync that started after this call has finished (the sync loop
        nudged), or after `timeout_s` (a registry that does not answer: the catalog keeps
        what it had). Blocks: for a thread, not the event loop."""
        with self._syncs:
            wanted = self._syncs_started + 1
        self._nudge.set()
        with self._syncs:
            self._syncs.wait_for(
                lambda: self._syncs_done >= wanted or self._closed.is_set(), timeout_s
            )

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Refresh workers and sync the catalog in the background while the app serves."""
        sync = threading.Thread(target=self._sync_loop, name="catalog-sync", daemon=True)
        sync.start()
        await self.follow_roster()
        await self.refresh()
        loops = [asyncio.create_task(self._refresh_loop())]
        if self.roster is not None:
            loops.append(asyncio.create_task(self._roster_loop()))
        try:
            yield
        finally:
            for loop in loops:
                loop.cancel()
            self._closed.set()
            self._nudge.set()
            sync.join(timeout=30)  # a sync under way finishes before its index goes
            self.catalog.close()
            await self.links.close()

    # Routing and forwarding.

    async def route(self, model: str | None) -> tuple[list[WorkerView], str | None]:
        """The workers to try, in order, for a request naming `model`, and the revision it
        names (None: the base)."""
        if model in BASE_NAMES or self._is_base(model):
            workers = self.fleet.for_base_model(model)
            if not workers:
                raise NotFoundError(f"no worker up serves the base {model!r}")
            return workers, None
        registered = await self._resolve(str(model))
        digest = registered.policy.base_digest
        revision = str(registered.id)
        own = self.catalog.replicas(registered.id.adapter) or self.replicas
        workers = len(self.fleet.serving_base(digest))
        choices = self.fleet.choices(revision, digest, self.demand.replicas(revision, own, workers))
        if not choices.workers:
            raise ServiceError(
                f"no worker up serves the base of {registered.id}, "
                f"{registered.policy.base_model_id} ({digest}); start one with MINT_BASE_MODEL "
                "set to it, or wait for a stopped one to come back"
            )
        first = choices.workers[0]
        asked = [w for w in choices.unready_placement if w is not first]  # the first admits
        if asked and self.catalog.in_front_of_users(registered):  # by demand itself, if it may
            for worker in asked:
                self._ask_admit(worker, registered.id)
        return choices.workers, revision

    async def _resolve(self, model: str) -> RegisteredRevision:
        """The revision `model` names. What the catalog answered recently (and still holds) is
        answered on the event loop: a thread hop (two wake-ups, most of a resolve's cost) is
        only for what the catalog has to read from its index or the registry, which must not
        block the loop."""
        ref = RevisionRef.parse(model)
        cached = self.catalog.cached(ref)
        if cached is not None:
            return cached
        return await asyncio.to_thread(self.catalog.resolve, ref)

    def _ask_admit(self, worker: WorkerView, revision: RevisionId) -> None:
        """Ask `worker` to admit `revision` by demand, in the background, at most every
        ASK_INTERVAL_S."""
        now = time.monotonic()
        key = (worker.url, str(revision))
        if now - self._asked.get(key, -ASK_INTERVAL_S) < ASK_INTERVAL_S:
            return
        self._asked[key] = now
        if len(self._asked) > 10_000:
            self._asked = {k: t for k, t in self._asked.items() if now - t < ASK_INTERVAL_S}
        body = AdmitRequest.of(revision, "demand").model_dump()

        async def ask() -> None:
            try:
                url = worker.url + "/admin/admit"
                async with self.links.of(worker.url).session.post(
                    url, json=body, headers=self._admin_headers
                ) as a:
                    if a.status >= 400:
                        log.warning("%s refused to admit %s: %s", worker.url, revision, a.status)
            except (aiohttp.ClientError, TimeoutError) as e:
                log.warning("could not ask %s to admit %s: %s", worker.url, revision, e)

        task = asyncio.get_running_loop().create_task(ask())
        self._asking.add(task)
        task.add_done_callback(self._asking.discard)

    def _is_base(self, model: str | None) -> bool:
        return any(w.base_model == model for w in self.fleet.workers)

    async def forward(self, request: Request, body: bytes, model: str | None) -> Response:
        """Forward a generation request once its principal's quota lets it in (429 if not);
        its place in the quota is given back when its answer has been sent, a stream's too."""
        principal = principal_of_header(self.api_keys, request.headers.get("authorization"))
        admitted = self.limiter.admit(principal, prompt_tokens=0)
        try:
            response = await self._forward(request, body, model)
        except BaseException:
            admitted.finished(0)
            raise
        response.background = BackgroundTask(admitted.finished, 0)
        return response

    async def _forward(self, request: Request, body: bytes, model: str | None) -> Response:
        workers, revision = await self.route(model)
        if revision is None:
            return await forward_to(self.links, request, body, model, workers, None)
        answer = await self._forward_revision(request, body, model, workers, revision)
        moved = not_ready_revision(answer)
        if moved is None or moved == revision:
            return answer
        # The worker resolved `model` to a revision this gateway has not synced yet: an alias
        # moved since its last sync (an activation nudges the workers, not the gateways). The
        # request goes again, once, where the catalog caught up says.
        await asyncio.to_thread(self.synced)
        workers, revision = await self.route(model)
        assert revision is not None  # `model` names an adapter: it did a moment ago
        return await self._forward_revision(request, body, model, workers, revision)

    async def _forward_revision(
        self,
        request: Request,
        body: bytes,
        model: str | None,
        workers: list[WorkerView],
        revision: str,
    ) -> Response:
        self.demand.started(revision)
        try:
            return await forward_to(self.links, request, body, model, workers, revision)
        finally:
            self.demand.finished(revision)

    async def feedback(self, request: Request, body: bytes) -> Response:
        """A score for a request id, from the worker that answered it (see the module's doc)."""
        headers = {"content-type": "application/json"}
        if authorization := request.headers.get("authorization"):
            headers["authorization"] = authorization
        unknown: Response | None = None
        for worker in [w for w in self.fleet.workers if w.up]:
            url = worker.url + request.url.path
            try:
                async with self.links.of(worker.url).session.post(
                    url, data=body, headers=headers
                ) as answer:
                    content = await answer.read()
                    if answer.status != 404:
                        return whole_answer(answer, worker, content)
                    unknown = whole_answer(answer, worker, content)
            except (aiohttp.ClientError, TimeoutError) as e:
                worker.down(f"{type(e).__name__}: {e}")
        if unknown is not None:
            return unknown
        raise ServiceError("no worker is up to take the feedback; send it again shortly")

    async def models(self, request: Request) -> Response:
        """The union of every worker's `/v1/models` for this caller; a caller every worker
        refuses (an unknown key: 401) gets the first refusal, not an empty list."""
        headers = {}
        if authorization := request.headers.get("authorization"):
            headers["authorization"] = authorization

        async def one(view: WorkerView) -> list[dict[str, object]] | Response:
            try:
                session = self.links.of(view.url).session
                async with session.get(view.url + "/v1/models", headers=headers) as answer:
                    if answer.status == 200:
                        return (await answer.json())["data"]
                    return whole_answer(answer, view, await answer.read())
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
                return []

        answers = await asyncio.gather(*(one(w) for w in self.fleet.workers if w.up))
        listed = [entries for entries in answers if not isinstance(entries, Response)]
        refused = [a for a in answers if isinstance(a, Response) and 400 <= a.status_code < 500]
        if refused and not listed:
            return refused[0]
        union: dict[str, dict[str, object]] = {}
        for entries in listed:
            for entry in entries:
                union.setdefault(str(entry["id"]), entry)
        return json_answer({"object": "list", "data": list(union.values())})

    async def document(self, routes: list[Route]) -> dict[str, object]:
        """The gateway's OpenAPI document (`serving.gateway.requests`), from the first worker
        up that describes its own; kept once made (the workers of one release agree)."""
        if self._document is not None:
            return self._document
        for worker in [w for w in self.fleet.workers if w.up]:
            try:
                described = self.links.of(worker.url).session.get(
                    worker.url + "/openapi.json", timeout=_POLL
                )
                async with described as a:
                    a.raise_for_status()
                    self._document = gateway_document(await a.json(), routes)
                    return self._document
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                log.warning("%s did not describe its API: %s", worker.url, e)
        raise ServiceError(
            "no worker is up to describe the requests this gateway forwards; ask again shortly"
        )

    def health(self) -> dict[str, object]:
        up = [w for w in self.fleet.workers if w.up]
        leaving = [
            {"url": w.url, "up": False, "base_model": w.base_model, "base_digest": w.base_digest,
             "ready": 0, "in_flight": w.in_flight, "leaving": True, "problem": "it left the "
             "fleet; its requests in flight finish there"}
            for w in self.fleet.leaving
        ]  # fmt: skip
        return {
            "status": "ok" if up and self.catalog.unreachable is None else "degraded",
            "registry_problem": self.catalog.unreachable,
            "workers": [
                {"url": w.url, "up": w.up, "base_model": w.base_model, "base_digest": w.base_digest,
                 "ready": len(w.ready), "in_flight": w.in_flight, "leaving": w.leaving,
                 "problem": w.problem}
                for w in self.fleet.workers
            ] + leaving,
        }  # fmt: skip

    def app(self, max_request_bytes: int = MAX_REQUEST_BYTES) -> Starlette:
        # Errors, an unknown route or method too, answer from the one table
        # (`install_error_handlers`).
        async def generation(request: Request) -> Response:
            body = await request.body()
            # Under an adapter's base URL the path names the revision; the worker, which gets
            # the same path, refuses a body that names another.
            ref = request.path_params.get("ref")
            model = adapter_of_url(ref) if ref else model_of(request.url.path, body)
            return await self.forward(request, body, model)

        async def models(request: Request) -> Response:
            return await self.models(request)

        async def feedback(request: Request) -> Response:
            return await self.feedback(request, await request.body())

        async def health(_: Request) -> Response:
            return json_answer(self.health())

        async def openapi(_: Request) -> Response:
            return json_answer(await self.document(routes))

        @asynccontextmanager
        async def lifespan(_: Starlette) -> AsyncIterator[None]:
            async with self.running():
                yield

        paths = ("/generate", "/generate_stream", "/", "/v1/completions", "/v1/chat/completions")
        paths += (ADAPTER_PREFIX, *(ADAPTER_PREFIX + path for path in paths))
        routes = [Route(path, generation, methods=["POST"]) for path in paths]
        routes += [Route("/v1/models", models), Route("/health", health)]
        routes.append(Route("/v1/feedback", feedback, methods=["POST"]))
        routes.append(Route("/openapi.json", openapi, include_in_schema=False))
        app = Starlette(routes=routes, lifespan=lifespan)
        install_error_handlers(app, "gateway")
        app.add_middleware(BodyLimit, limit=max_request_bytes)
        return app


def build_gateway(config: MintConfig) -> Gateway:
    """A gateway whose catalog (every base's revisions) starts from the snapshot in the
    artifact store, if there is one, like a worker's; with MINT_FLEET=registry its fleet
    follows the workers announcing themselves (MINT_WORKER_URLS alone: fixed, as it always
    was)."""
    registry = Registry(config.tracking_uri)
    catalog = Catalog(registry, folder=config.home / "catalog")
    catalog.start_from_snapshot(open_store(config))
    static = config.fleet.source is FleetSource.STATIC
    return Gateway(
        config.worker_urls,
        catalog,
        config.worker_api_key,
        sync_interval_s=config.sync_interval_s,
        replicas=config.replicas,
        hot_rate=config.hot_rate,
        roster=None if static else open_roster(config, registry),
        api_keys=config.api_keys,
        tenancy=TenancyFile(config.tenancy_file, config.tenancy_shares),
    )


def serve_gateway(config: MintConfig, host: str = LOOPBACK, port: int = GATEWAY_PORT) -> None:
    notice_registry_outages_quickly()
    app = build_gateway(config).app()
    serve_http(app, host, port, config.http_bounds, config.tls)


def start_gateway(
    config: MintConfig,
    port: int | None = None,
    timeout_s: float = 120.0,
    env: Mapping[str, str] | None = None,
) -> ManagedProcess:
    """A gateway in a child process on loopback; returns once `/health` answers. `env`: more
    of its environment (e.g. the registry account it reads with)."""
    return start_mint("gateway", "gateway", "gateway", config, port, timeout_s, env)
