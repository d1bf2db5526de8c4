"""The gateway's routing answers a model name the catalog answered recently on the event loop,
without a thread hop, and goes to the catalog off the loop again once a sync changed that
adapter, and only that adapter (a real catalog, against a registry held in memory).

Under partitions and a changing fleet: a worker that does not take a connection in time is
skipped for the next; one the refresh finds unreachable has its requests ended with a 502
`worker_unreachable` (one that still sends something is slow, and keeps them); the fleet follows
a roster, a leaver keeping its requests in flight until they are done."""

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
import pytest
from aiohttp import web

from mint_core.catalog.catalog import Catalog
from mint_core.errors import NotFoundError
from mint_core.revisions import RevisionRef
from serving.gateway import app as gateway_app
from serving.gateway import links
from serving.gateway.app import Gateway
from serving.gateway.fleet import Fleet, WorkerView
from serving.gateway.forward import WORKER_HEADER, never_answered
from tests.helpers import BASE_DIGEST, MemoryRegistry, make_policy

SERVED_BASE = make_policy().base_digest
"""The base of every revision a `MemoryRegistry` holds (its policies are `make_policy`'s)."""


@pytest.fixture
def registry() -> MemoryRegistry:
    registry = MemoryRegistry()
    for number in (1, 2):
        registry.add("bot", number)
    registry.set("bot", production=1)
    registry.clock_ms += 10_000  # bot's change is older than a sync asks for again
    registry.add("other", 1)
    registry.add("other", 2)
    return registry


@pytest.fixture
def catalog(registry: MemoryRegistry, tmp_path: Path) -> Iterator[Catalog]:
    catalog = Catalog(registry, base_digest=BASE_DIGEST, folder=tmp_path)
    catalog.sync()
    yield catalog
    catalog.close()


def gateway(catalog: Catalog, monkeypatch: pytest.MonkeyPatch) -> tuple[Gateway, list[str]]:
    """A gateway over `catalog`, with one worker serving bot:r1 and bot:r2, and the list of
    what it asked the catalog to resolve off the event loop."""
    gw = Gateway(["http://127.0.0.1:1"], catalog)
    worker = gw.fleet.workers[0]
    worker.update({"base_model": "acme/base", "base_digest": SERVED_BASE, "in_flight": 0,
                   "ready": ["bot:r1", "bot:r2"], "device_slots": []})  # fmt: skip
    hopped: list[str] = []
    resolve = catalog.resolve

    def counted(ref: RevisionRef) -> object:
        hopped.append(str(ref))
        return resolve(ref)

    monkeypatch.setattr(catalog, "resolve", counted)
    return gw, hopped


def routes(gw: Gateway, model: str) -> list[str | None]:
    async def three() -> list[str | None]:
        return [(await gw.route(model))[1] for _ in range(3)]

    return asyncio.run(three())


def test_a_resolved_name_is_answered_on_the_loop_until_a_sync_changes_its_adapter(
    catalog: Catalog, registry: MemoryRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    gw, hopped = gateway(catalog, monkeypatch)
    assert routes(gw, "bot@production") == ["bot:r1"] * 3
    assert routes(gw, "bot") == ["bot:r1"] * 3  # the same question: production by default
    assert hopped == ["bot@production"]
    registry.set("other", production=2)
    gw.sync_catalog()  # another adapter changed: bot's answer is still on the loop
    assert routes(gw, "bot@production") == ["bot:r1"] * 3
    assert hopped == ["bot@production"]

    registry.set("bot", production=2)  # the alias moved
    gw.sync_catalog()
    assert routes(gw, "bot@production") == ["bot:r2"] * 3
    assert hopped == ["bot@production"] * 2
    assert routes(gw, "bot:r1") == ["bot:r1"] * 3
    assert hopped == ["bot@production"] * 2 + ["bot:r1"]


def test_a_failed_resolution_is_never_kept(
    catalog: Catalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    gw, hopped = gateway(catalog, monkeypatch)
    for _ in range(2):
        with pytest.raises(NotFoundError):
            asyncio.run(gw.route("ghost@production"))
    assert hopped == ["ghost@production"] * 2


# A cut-off worker, a slow one, a fleet that changes: fake workers are aiohttp servers on
# loopback in the test's own event loop; the gateway's app is called through httpx's ASGI
# transport, and its refresh is called by hand.

ROUTING = {"base_model": "acme/base", "base_digest": SERVED_BASE, "in_flight": 0, "ready": [],
           "device_slots": []}  # fmt: skip
ANSWER = {"generated_text": "hi"}


@dataclass
class FakeWorker:
    """A worker that answers `/generate` and `/admin/routing` at once, or hangs (`stalled`:
    takes requests, never answers: a host cut off or stopped), or streams (`stream`)."""

    stalled: bool = False
    stream: bool = False
    chunk_every_s: float | None = None
    """With `stream`: a chunk this often, forever (a slow worker that still talks)."""
    hold: asyncio.Event | None = None
    """Answers `/generate` only once set (a long generation)."""
    leaving: bool = False
    """What `/admin/routing` says: told to stop, finishing what it has."""
    ready: tuple[str, ...] = ()
    """What `/admin/routing` says it holds ready."""
    not_ready: str | None = None
    """Answers `/generate` 503 "not ready" for this revision (the one it resolved the name to)."""
    seen: int = 0
    url: str = ""
    _runner: web.AppRunner | None = None
    _site: web.TCPSite | None = None

    async def generate(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.seen += 1
        if self.stream:
            answer = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await answer.prepare(request)
            await answer.write(b"data: {}\n\n")
            while self.chunk_every_s is not None:
                await asyncio.sleep(self.chunk_every_s)
                await answer.write(b"data: {}\n\n")
            await asyncio.Event().wait()
        if self.stalled:
            await asyncio.Event().wait()
        if self.hold is not None:
            await self.hold.wait()
        if self.not_ready is not None:
            body = {"error": "not ready", "error_type": "not_ready", "id": self.not_ready}
            return web.json_response(body, status=503, headers={"Retry-After": "1"})
        return web.json_response(ANSWER)

    async def routing(self, _: web.Request) -> web.Response:
        if self.stalled:
            await asyncio.Event().wait()
        answer = web.json_response(ROUTING | {"leaving": self.leaving, "ready": list(self.ready)})
        if self.leaving:
            answer.force_close()  # as uvicorn closes idle connections when it stops listening
        return answer

    async def start(self) -> "FakeWorker":
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/admin/routing", self.routing)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await self._site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def close_listener(self) -> None:
        """Refuse new connections; those open go on (a worker at the end of its drain)."""
        assert self._site is not None
        await self._site.stop()

    async def stop(self) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


@contextmanager
def unconnectable() -> Iterator[str]:
    """A URL whose connections are never taken: a listening socket whose backlog is full, so
    the kernel drops each new SYN (like a host cut off, on loopback)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        fillers = [socket.socket() for _ in range(4)]
        for filler in fillers:
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            for filler in fillers:
                filler.close()


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """Connect and poll timeouts short enough for a unit test."""
    monkeypatch.setattr(links, "CONNECT_TIMEOUT_S", 0.3)
    monkeypatch.setattr(gateway_app, "_POLL", aiohttp.ClientTimeout(total=0.3))


def up(gw: Gateway) -> None:
    for worker in gw.fleet.workers:
        worker.update(ROUTING)


def client(gw: Gateway) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=gw.app())
    return httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=30)


async def generate(http: httpx.AsyncClient) -> httpx.Response:
    return await http.post("/generate", json={"inputs": "hello"})


@pytest.mark.usefixtures("quick")
def test_a_connect_timeout_moves_on_to_the_next_worker(catalog: Catalog) -> None:
    async def run() -> None:
        taker = await FakeWorker().start()
        with unconnectable() as silent:
            gw = Gateway([silent, taker.url], catalog)
            up(gw)
            async with client(gw) as http:
                started = time.monotonic()
                answer = await generate(http)
                took = time.monotonic() - started
            await gw.links.close()
        await taker.stop()
        assert answer.status_code == 200 and answer.json() == ANSWER
        assert answer.headers[WORKER_HEADER] == taker.url and taker.seen == 1
        assert 0.3 <= took < 5, took
        assert not gw.fleet.workers[0].up  # until the refresh hears from it
        assert "did not take a connection" in str(gw.fleet.workers[0].problem)

    asyncio.run(run())


@pytest.mark.usefixtures("quick")
def test_when_no_worker_takes_the_connection_the_client_is_told_when_to_ask_again(
    catalog: Catalog,
) -> None:
    async def run() -> None:
        with unconnectable() as silent:
            gw = Gateway([silent], catalog)
            up(gw)
            async with client(gw) as http:
                answer = await generate(http)
            await gw.links.close()
        assert answer.status_code == 503 and answer.json()["error_type"] == "unavailable"
        assert "refused the connection or did not take it" in answer.json()["error"]
        assert answer.headers["Retry-After"] == "1"  # a client honouring it asks again

    asyncio.run(run())


@pytest.mark.usefixtures("quick")
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_worker_found_unreachable_has_its_requests_ended_with_a_502(
    catalog: Catalog, stream: bool
) -> None:
    """Its request in flight ends when the refresh finds it unreachable; the next request goes
    to the other worker."""

    async def run() -> None:
        stalled = await FakeWorker(stalled=not stream, stream=stream).start()
        other = await FakeWorker().start()
        gw = Gateway([stalled.url, other.url], catalog)
        up(gw)
        async with client(gw) as http:
            pending = asyncio.create_task(generate(http))
            while not stalled.seen:
                await asyncio.sleep(0.01)
            stalled.stalled = True  # its routing poll hangs from now on
            await asyncio.sleep(0.1)  # a stream's first chunk is heard before the poll
            started = time.monotonic()
            await gw.refresh()
            ended = await asyncio.wait_for(pending, 5)
            took = time.monotonic() - started
            after = await generate(http)
        await gw.links.close()
        for worker in (stalled, other):
            await worker.stop()
        if stream:
            assert ended.status_code == 200  # the stream had begun: its last event says why
            error = json.loads(ended.text.strip().splitlines()[-1].removeprefix("data:"))
        else:
            assert ended.status_code == 502 and ended.headers[WORKER_HEADER] == stalled.url
            assert ended.headers["content-type"] == "application/json"
            error = ended.json()
        assert error["error_type"] == "worker_unreachable", error
        assert "send it again" in error["error"] and stalled.url in error["error"]
        assert took < 2, took
        assert after.status_code == 200 and after.headers[WORKER_HEADER] == other.url
        assert not gw.fleet.workers[0].up and gw.fleet.workers[0].in_flight == 0

    asyncio.run(run())


@pytest.mark.usefixtures("quick")
def test_a_slow_worker_that_still_streams_keeps_its_requests(catalog: Catalog) -> None:
    """Its routing poll times out (it is down for new requests) but its stream's chunks keep
    coming, so it is slow, not cut off; once they stop too, the next refresh ends the stream."""

    async def run() -> None:
        slow = await FakeWorker(stream=True, chunk_every_s=0.01).start()
        gw = Gateway([slow.url], catalog)
        up(gw)
        async with client(gw) as http:
            pending = asyncio.create_task(generate(http))
            while not slow.seen:
                await asyncio.sleep(0.01)
            slow.stalled = True
            await gw.refresh()
            assert not gw.fleet.workers[0].up and not pending.done()
            slow.chunk_every_s = None  # now it says nothing at all (after one last chunk)
            deadline = time.monotonic() + 10
            while not pending.done() and time.monotonic() < deadline:
                await gw.refresh()  # the first refresh to hear nothing ends the stream
                await asyncio.sleep(0.01)
            ended = await asyncio.wait_for(pending, 5)
        await gw.links.close()
        await slow.stop()
        assert ended.status_code == 200 and ended.text.count("data: {}") >= 2
        assert '"error_type":"worker_unreachable"' in ended.text.replace(" ", "")

    asyncio.run(run())


class FakeRoster:
    """A roster whose fleet the test sets (`mint_core.membership.Roster`)."""

    def __init__(self, *urls: str) -> None:
        self.urls = tuple(sorted(urls))
        self.reads = 0

    def refresh(self) -> None:
        self.reads += 1

    def fleet(self) -> tuple[str, ...]:
        return self.urls


def test_reconcile_adds_joiners_down_and_keeps_a_busy_leaver_until_it_is_done() -> None:
    a, b, c, d = (WorkerView(f"http://w{n}") for n in range(4))
    fleet = Fleet([b, a, c])
    b.in_flight = 2
    change = fleet.reconcile(["http://w0", "http://w2/", "http://w3"])
    assert [w.url for w in fleet.workers] == ["http://w0", "http://w2", "http://w3"]
    assert change.joined == [fleet.workers[2]] and not fleet.workers[2].up
    assert change.left == [b] and fleet.leaving == [b]  # its two requests finish there
    assert fleet.drained() == [] and fleet.leaving == [b]
    b.in_flight = 0
    assert fleet.drained() == [b] and fleet.leaving == []
    c.in_flight = 1
    fleet.reconcile(["http://w0", "http://w3"])
    assert fleet.leaving == [c]
    fleet.reconcile(["http://w0", "http://w2", "http://w3"])  # back before it drained
    assert fleet.leaving == [] and fleet.workers[-1] is c and d.url not in fleet.leaving


def test_the_gateway_follows_its_roster(catalog: Catalog) -> None:
    """A joiner is routed to once its first refresh answers; a leaver takes no new request."""

    async def run() -> None:
        first, second = await FakeWorker().start(), await FakeWorker().start()
        roster = FakeRoster(first.url)
        gw = Gateway([], catalog, roster=roster)
        async with client(gw) as http:
            await gw.follow_roster()
            assert [w.url for w in gw.fleet.workers] == [first.url]
            roster.urls = tuple(sorted([first.url, second.url]))
            await gw.follow_roster()
            joiner = next(w for w in gw.fleet.workers if w.url == second.url)
            assert not joiner.up and joiner.problem == "not heard from yet"
            await gw.refresh()
            assert joiner.up
            roster.urls = (second.url,)
            await gw.follow_roster()
            answers = [await generate(http) for _ in range(3)]
        await gw.links.close()
        for worker in (first, second):
            await worker.stop()
        assert roster.reads == 3
        assert [a.headers[WORKER_HEADER] for a in answers] == [second.url] * 3
        assert [w.url for w in gw.fleet.workers] == [second.url] and gw.fleet.leaving == []

    asyncio.run(run())


# A worker leaving (`serving.worker.leaving`): it says so in /admin/routing, is sent nothing new,
# and closes its listener with requests still finishing; a relay in front of it meanwhile
# accepts connections and closes them with nothing behind.


def test_a_leaving_worker_is_routed_nothing_new() -> None:
    staying, leaving = WorkerView("http://w0"), WorkerView("http://w1")
    for view in (staying, leaving):
        view.update(ROUTING | {"ready": ["bot:r1"]})
    leaving.update(ROUTING | {"ready": ["bot:r1"], "leaving": True})
    fleet = Fleet([leaving, staying])
    assert leaving.up and not leaving.routable and staying.routable
    assert fleet.for_base_model(None) == [staying]
    assert fleet.serving_base(SERVED_BASE) == [staying]
    assert fleet.choices("bot:r1", SERVED_BASE, 1).workers == [staying]
    leaving.update(ROUTING | {"ready": ["bot:r1"]})  # started again: routed to again
    assert leaving.routable and len(fleet.for_base_model(None)) == 2


def test_a_leaving_worker_that_closes_its_listener_keeps_its_requests(catalog: Catalog) -> None:
    """Its requests in flight are not ended when its poll is refused: it closed its listener
    as it left, and finishes them on the connections it keeps."""

    async def run() -> None:
        leaver = await FakeWorker(hold=asyncio.Event()).start()
        other = await FakeWorker().start()
        gw = Gateway([leaver.url, other.url], catalog)
        up(gw)
        async with client(gw) as http:
            pending = asyncio.create_task(generate(http))
            while not leaver.seen:
                await asyncio.sleep(0.01)
            leaver.leaving = True
            await gw.refresh()
            sent_after = [await generate(http) for _ in range(3)]
            await leaver.close_listener()
            await gw.refresh()  # refused
            assert not gw.fleet.workers[0].up and not pending.done()
            assert leaver.hold is not None
            leaver.hold.set()
            ended = await asyncio.wait_for(pending, 5)
        await gw.links.close()
        for worker in (leaver, other):
            await worker.stop()
        assert ended.status_code == 200 and ended.headers[WORKER_HEADER] == leaver.url
        assert [a.headers[WORKER_HEADER] for a in sent_after] == [other.url] * 3

    asyncio.run(run())


@contextmanager
def relay_with_nothing_behind() -> Iterator[str]:
    """A URL that takes connections and closes them at once, having read nothing: a relay or
    load balancer in front of a worker that has closed its listener."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        listener.settimeout(0.1)
        stop = threading.Event()

        def close_each() -> None:
            while not stop.is_set():
                try:
                    taken, _ = listener.accept()
                except TimeoutError:
                    continue
                taken.close()

        closer = threading.Thread(target=close_each, daemon=True)
        closer.start()
        try:
            yield f"http://127.0.0.1:{listener.getsockname()[1]}"
        finally:
            stop.set()
            closer.join()


def test_a_connection_closed_before_any_answer_goes_to_the_next_worker(catalog: Catalog) -> None:
    async def run() -> None:
        taker = await FakeWorker().start()
        with relay_with_nothing_behind() as closing:
            gw = Gateway([closing, taker.url], catalog)
            up(gw)
            async with client(gw) as http:
                answer = await generate(http)
            await gw.links.close()
        await taker.stop()
        assert answer.status_code == 200 and answer.json() == ANSWER
        assert answer.headers[WORKER_HEADER] == taker.url and taker.seen == 1
        assert not gw.fleet.workers[0].up  # until a poll answers again
        assert "closed the connection before answering" in str(gw.fleet.workers[0].problem)

    asyncio.run(run())


RETRIED = {
    "closed with nothing sent (a relay with nothing behind)": (
        aiohttp.ServerDisconnectedError(),
        None,
        True,
    ),
    "reset before an answer": (aiohttp.ClientOSError(104, "Connection reset by peer"), None, True),
    "the gateway cut its link (cut off: it may be running it)": (
        aiohttp.ServerDisconnectedError(),
        "the gateway could not reach it",
        False,
    ),
    "a timeout": (TimeoutError(), None, False),
    "a read timeout": (aiohttp.SocketTimeoutError(), None, False),
    "a payload error": (aiohttp.ClientPayloadError(), None, False),
}


@pytest.mark.parametrize("error, cut, retried", RETRIED.values(), ids=RETRIED.keys())
def test_which_failures_before_an_answer_go_to_the_next_worker(
    error: BaseException, cut: str | None, retried: bool
) -> None:
    link = links.Link(session=None, cut=cut)  # type: ignore[arg-type]
    assert never_answered(error, link) is retried


def test_a_worker_that_saw_an_alias_move_first_sends_the_request_where_the_gateway_catches_up(
    catalog: Catalog, registry: MemoryRegistry
) -> None:
    """Production moves r1 -> r2 and the workers hear of it (an activation nudges them) before
    the gateway's next sync. r1 is ready nowhere, so the gateway, by its view, sends the request
    to r1's placement, whose "not ready" would be the answer (it admits r1 by demand); but that
    worker resolved the name to r2, which it does not hold: the gateway syncs at once and the
    request goes to r2's worker, the client none the wiser."""

    async def run() -> None:
        fakes = [await FakeWorker().start(), await FakeWorker().start()]
        gw = Gateway([fake.url for fake in fakes], catalog, sync_interval_s=3600)
        async with gw.running(), client(gw) as http:
            workers, revision = await gw.route("bot@production")
            assert revision == "bot:r1"
            (placed,) = [fake for fake in fakes if fake.url == workers[0].url]
            (other,) = [fake for fake in fakes if fake is not placed]
            placed.not_ready, other.ready = "bot:r2", ("bot:r2",)
            await gw.refresh()
            registry.set("bot", production=2)
            started = time.monotonic()
            answer = await http.post(
                "/generate", json={"inputs": "hello", "parameters": {"adapter_id": "bot"}}
            )
            took = time.monotonic() - started
        for fake in fakes:
            await fake.stop()
        assert answer.status_code == 200 and answer.json() == ANSWER, answer.text
        assert answer.headers[WORKER_HEADER] == other.url
        assert (placed.seen, other.seen) == (1, 1)
        assert took < 5, took  # one sync, not its hour-long interval

    asyncio.run(run())
