"""`mint gateway`: one front door for a fleet of workers serving several bases.

Clients call the gateway with the workers' own APIs (TGI and OpenAI, streaming included, and
each revision reference's own base URL, `/adapters/{ref}`); the gateway reads which revision a
request names (there: the path), resolves it in its catalog to the revision and its base, and
forwards the request unchanged (the `Authorization` header too: each worker still authorises
its callers) to a worker of that base. Each revision is held by its placement
(`mint_core.planning.placement`: the workers of its base it ranks first, as many as its
replicas, more while it is hot), and the gateway tries, in order:

1. workers of its placement where it is ready, one already holding it in a device slot first
   (adapter affinity: no copy into a slot for this request), then fewest requests in flight
   (this gateway's own count, then the worker's last reported load);
2. other workers where it is ready (it stays there until evicted, so an alias move or a worker
   joining causes no cold misses);
3. if it is ready nowhere, its placement's first worker (or the next-ranked, if that one does
   not take the connection): that worker answers "not ready" at once (503 with `Retry-After`)
   and admits the revision by demand. The gateway passes that answer on; it is not retried
   elsewhere, which would only admit the revision on more workers.

While a revision is hot (its request rate or requests in flight per replica above
MINT_HOT_RATE, `Demand`), it gets more replicas: the gateway asks the next-ranked workers to
admit it by demand, and spreads its requests over them once they have it ready; when it cools,
the gateway stops sending to the extra ones, whose host tiers then evict it in time.

Feedback (`POST /v1/feedback`) goes to the worker that answered the request: the gateway asks
each worker up in turn, and the first whose answer is not 404 (an id it does not know) answers.
Request ids are random, so no other worker claims one; a fleet is a few workers, so this is a
few loopback calls at most, and no state to keep in the gateway.

A 503 from a worker (not ready, engine restarting) or a worker that does not take the
connection is retried on the next worker; once a worker has the request, its failure is the
request's (a generation is not replayed), answered as a clean 502 or, in a stream that has
started, as a last error event.

Errors answer from the workers' table (`serving.http.errors`), in their JSON shape, unknown
routes and methods too. Of a body the gateway reads only the model it names, checked as a
worker checks it (`serving.gateway.requests`); the worker validates the rest. Its OpenAPI
document (`/openapi.json`) is its workers' for the routes it forwards.

What the gateway knows about workers it re-reads from them every `refresh_s`
(`/admin/routing`: base, ready revisions, device slots, load); what it knows about revisions
comes from the registry, like a worker's catalog. It holds nothing else: two gateways can only
differ in how fresh their copies are, so any number of them can stand behind a plain load
balancer.
"""

from serving.gateway.app import (
    WORKER_HEADER,
    Gateway,
    build_gateway,
    serve_gateway,
    start_gateway,
)
from serving.gateway.fleet import Choices, Fleet, WorkerView

__all__ = [
    "WORKER_HEADER",
    "Choices",
    "Fleet",
    "Gateway",
    "WorkerView",
    "build_gateway",
    "serve_gateway",
    "start_gateway",
]
