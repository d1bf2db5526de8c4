"""How long an HTTP connection to a MinT service (worker, gateway, trainer) may keep it
waiting, and how many it serves at once: `ConnectionBounds`, the setting MINT_HTTP_BOUNDS.

Only reading a request is bounded in time: once a request has arrived whole, its answer takes
as long as it takes (a generation stream, the trainer's long-polls). `serving.http.server`
carries the bounds out."""

from dataclasses import dataclass, fields, replace

__all__ = ["ConnectionBounds"]


@dataclass(frozen=True)
class ConnectionBounds:
    """Time and count bounds of a service's connections. Written (MINT_HTTP_BOUNDS) as
    `name=value` pairs, e.g. `head_s=10,body_s=10,keep_alive_s=5,connections=1000`; a name
    left out keeps its default."""

    keep_alive_s: float = 5.0
    """An idle connection is closed this long after its last answer. uvicorn's default: long
    enough for a client's next request of a burst (httpx, the SDKs' client, keeps an idle
    connection 5 s too), short enough that idle connections do not pile up."""
    head_s: float = 10.0
    """A request's head (request line and headers) must arrive whole within this long of the
    connection opening or of the previous answer, however it is trickled in. A head is a few
    hundred bytes, one packet for any real client: 10 s covers a slow link many times over."""
    body_s: float = 10.0
    """A request body that stops arriving for this long is answered 408 and its connection
    closed. A client that sends a body sends it continuously; 10 s without a byte is a client
    that is gone or stalling on purpose."""
    connections: int = 1000
    """Open connections (idle ones too) and requests in flight a service takes; a request
    beyond them is answered 503 (Retry-After) and its connection closed. 1,000 is far more
    than the engine serves at once (it batches, `max_batch`) and takes one file descriptor
    each; a connection is never held longer than the bounds above unless its request is
    being answered."""

    def __post_init__(self) -> None:
        for name in ("keep_alive_s", "head_s", "body_s"):
            value = getattr(self, name)
            if not 0 < value < float("inf"):
                raise ValueError(f"has {name}={value:g}; it must be a positive number of seconds")
        if self.connections < 1:
            raise ValueError(f"has connections={self.connections}; it must be at least 1")

    @classmethod
    def parse(cls, text: str) -> "ConnectionBounds":
        """The bounds `text` (`name=value,...`) sets, the defaults for the names it leaves out;
        ValueError naming an unknown name or a bad value."""
        known = [f.name for f in fields(cls)]
        changes: dict[str, float | int] = {}
        for pair in filter(None, (part.strip() for part in text.split(","))):
            name, _, value = (part.strip() for part in pair.partition("="))
            if name not in known:
                raise ValueError(f"names {name[:40]!r}; the bounds are {', '.join(known)}")
            try:
                changes[name] = int(value) if name == "connections" else float(value)
            except ValueError:
                raise ValueError(f"has {name}={value[:40]!r}, which is not a number") from None
        return replace(cls(), **changes)

    def __str__(self) -> str:
        return ",".join(f"{f.name}={getattr(self, f.name):g}" for f in fields(self))
