"""The gateway's copy of the fleet: each worker's base, ready revisions and load, and the order
in which it tries them for a revision (placement first: see `serving.gateway`). A worker that
says it is leaving (`/admin/routing`'s `leaving`: told to stop, it finishes what it has) is sent
nothing new. Where the fleet is read from a roster (MINT_FLEET=registry), `reconcile` follows
its changes: a joiner is down until it first answers; a leaver takes no new request and is
kept, still refreshed, until the requests it had are done."""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from mint_core.errors import ConfigurationError
from mint_core.planning.placement import ranking
from serving.http.common import BASE_NAMES
from serving.http.wire import Routing


@dataclass
class WorkerView:
    """The gateway's copy of one worker, refreshed from `/admin/routing`."""

    url: str
    up: bool = False
    base_model: str = ""
    base_digest: str = ""
    ready: frozenset[str] = frozenset()
    slots: frozenset[str] = frozenset()
    reported_load: int = 0
    in_flight: int = 0
    """Requests this gateway has on the worker now."""
    problem: str | None = "not heard from yet"
    leaving: bool = False
    """It said it is leaving: routed nothing new; its requests finish there."""

    def update(self, answer: Mapping[str, object]) -> None:
        """Take the worker's `/admin/routing` answer; pydantic's ValidationError (a ValueError)
        for one that is not a `Routing`."""
        routing = Routing.model_validate(answer)
        self.base_model = routing.base_model
        self.base_digest = routing.base_digest
        self.ready = frozenset(routing.ready)
        self.slots = frozenset(routing.device_slots)
        self.reported_load = routing.in_flight
        self.leaving = routing.leaving
        self.up, self.problem = True, None

    @property
    def routable(self) -> bool:
        """Whether new requests may go to it: up and not leaving."""
        return self.up and not self.leaving

    def down(self, why: str) -> None:
        self.up, self.problem = False, why


@dataclass(frozen=True)
class Choices:
    """Where to send one request for a revision."""

    workers: list[WorkerView]
    """In the order to try them."""
    unready_placement: list[WorkerView]
    """Workers of its placement where it is not ready: asked to admit it while others serve."""


@dataclass(frozen=True)
class Change:
    """What one `reconcile` did."""

    joined: list[WorkerView]
    left: list[WorkerView]
    """Out of the fleet; those with requests in flight are in `leaving` until they are done."""


@dataclass
class Fleet:
    """Every worker the gateway routes to, and the order in which it tries them."""

    workers: list[WorkerView] = field(default_factory=list)
    leaving: list[WorkerView] = field(default_factory=list)
    """Workers gone from the roster with requests still in flight: refreshed, not routed to."""

    def reconcile(self, urls: Iterable[str]) -> Change:
        """Make the fleet the workers at `urls`: a joiner is down until its first refresh;
        the order of those that stay is kept (ties in load go to the earlier)."""
        wanted = list(dict.fromkeys(url.rstrip("/") for url in urls))
        kept = {w.url: w for w in self.workers if w.url in wanted}
        back = {w.url: w for w in self.leaving if w.url in wanted}  # rejoined while draining
        left = [w for w in self.workers if w.url not in kept]
        joined = [WorkerView(url) for url in wanted if url not in kept and url not in back]
        self.workers = [*kept.values(), *back.values(), *joined]
        self.leaving = [w for w in [*self.leaving, *left] if w.url not in back and w.in_flight]
        return Change(joined, left)

    def drained(self) -> list[WorkerView]:
        """Drop the leavers whose requests are done, and return them."""
        done = [w for w in self.leaving if not w.in_flight]
        self.leaving = [w for w in self.leaving if w.in_flight]
        return done

    def serving_base(self, digest: str) -> list[WorkerView]:
        return [w for w in self.workers if w.routable and w.base_digest == digest]

    def choices(self, revision: str, digest: str, replicas: int) -> Choices:
        """Workers of base `digest` in the order to try them for `revision`, held by
        `replicas` workers (see the module's doc)."""
        workers = self.serving_base(digest)
        ranked = {url: rank for rank, url in enumerate(ranking(revision, [w.url for w in workers]))}
        placed = {url for url, rank in ranked.items() if rank < replicas}

        def preference(w: WorkerView) -> tuple[bool, bool, bool, int, int, int]:
            ready = revision in w.ready
            return (
                not ready,
                w.url not in placed,
                revision not in w.slots,
                w.in_flight if ready else 0,
                w.reported_load if ready else 0,
                ranked[w.url],
            )

        ordered = sorted(workers, key=preference)
        missing = [w for w in ordered if w.url in placed and revision not in w.ready]
        return Choices(ordered, missing)

    def for_base_model(self, model: str | None) -> list[WorkerView]:
        """Workers for a request that names a base (its model id) or nothing. Naming nothing is
        ambiguous in a fleet of several bases: ConfigurationError listing them."""
        up = [w for w in self.workers if w.routable]
        if model not in BASE_NAMES:
            return sorted((w for w in up if w.base_model == model), key=lambda w: w.in_flight)
        bases = sorted({w.base_model for w in up})
        if len(bases) > 1:
            raise ConfigurationError(
                f"this gateway serves several bases ({', '.join(bases)}): name one as the model, "
                "or name an adapter revision"
            )
        return sorted(up, key=lambda w: w.in_flight)
