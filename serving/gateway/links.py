"""The gateway's connections, one aiohttp session per worker, so that the gateway can end
exactly one worker's requests.

A worker cut off by the network sends no RST: a request on its way there, or sent on a pooled
keep-alive connection, would wait for the whole generation timeout. When the refresh finds the
worker unreachable (its poll timed out or its connection failed) and nothing else came from it
meanwhile, the gateway cuts its link: it closes each answer being read (closing the session
alone does not end a body already streaming: aiohttp drops its payload before the connection
is lost) and then the session (which ends the requests still waiting for an answer's head).
The forwarding, seeing the link cut, answers 502 `worker_unreachable`; the next request to that
worker opens a fresh session.
"""

import time
from dataclasses import dataclass, field

import aiohttp

from mint_core.connections import ConnectionBounds

CONNECT_TIMEOUT_S = 2.0
"""A worker that does not take a connection this fast is skipped for the next one."""
GENERATION_TIMEOUT_S = 600.0
"""The longest a request may take; one on a worker cut off ends sooner (see above)."""


@dataclass
class Link:
    """One worker's connections."""

    session: aiohttp.ClientSession
    cut: str | None = None
    """Why the gateway closed it, once it has: its requests failed because of that."""
    heard_at: float = float("-inf")
    """When something last came from the worker on it (an answer's head, a stream's chunk)."""
    reading: set[aiohttp.ClientResponse] = field(default_factory=set)
    """Answers whose heads have come and whose bodies are being read."""

    def heard(self) -> None:
        self.heard_at = time.monotonic()

    def opened(self, answer: aiohttp.ClientResponse) -> None:
        """`answer`'s head came: read its body until `closed`."""
        self.heard()
        self.reading.add(answer)

    def closed(self, answer: aiohttp.ClientResponse) -> None:
        self.reading.discard(answer)
        answer.release()


class Links:
    """Every worker's link, by URL, opened when first used."""

    def __init__(self) -> None:
        self._links: dict[str, Link] = {}

    def of(self, url: str) -> Link:
        """`url`'s link, a fresh one if it has none or it was cut."""
        link = self._links.get(url)
        if link is None:
            link = self._links[url] = Link(_session())
        return link

    async def cut(self, url: str, why: str) -> None:
        """End every request on `url`'s link; their forwarding tells the client `why`."""
        link = self._links.pop(url, None)
        if link is not None:
            link.cut = why
            for answer in list(link.reading):
                answer.close()  # its reader gets ClientConnectionError
            await link.session.close()

    async def cut_if_silent(self, url: str, link: Link, since: float, why: str) -> bool:
        """Cut `link`, if it is still `url`'s and nothing came from the worker on it at or
        after `since` (something did: the worker is slow, not cut off). Whether it was cut."""
        if self._links.get(url) is not link or link.heard_at >= since:
            return False
        await self.cut(url, why)
        return True

    async def close(self) -> None:
        for url in list(self._links):
            await self.cut(url, "the gateway is stopping")


def _session() -> aiohttp.ClientSession:
    # aiohttp, not httpx: a fifth of the CPU per forwarded request (measured here, 0.15 ms
    # against 0.8 ms), and the gateway's hop is all CPU.
    timeout = aiohttp.ClientTimeout(total=GENERATION_TIMEOUT_S, sock_connect=CONNECT_TIMEOUT_S)
    # An idle connection is reused for half as long as a worker keeps it open: aiohttp keeps it
    # 15 s by default, and a request sent on one the worker has just closed fails instead of
    # being answered.
    reuse_s = ConnectionBounds.keep_alive_s / 2
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=reuse_s)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False)
