"""`mint gateway`: one front door for a fleet of workers serving several bases.

Clients call it with the workers' own APIs (TGI and OpenAI, streaming included, and each
revision reference's base URL, `/adapters/{ref}`). It resolves the revision a request names in a
catalog of its own and forwards the request unchanged (the `Authorization` header too: each
worker still authorises its callers) to a worker of that revision's base, one where it is ready
if there is one. It holds nothing but copies, of the registry and of what each worker reports
every `refresh_s`, so any number of gateways can stand behind a plain load balancer. How it
picks a worker, retries, spreads a hot revision, and finds the worker that answered a request
for its feedback: the README, "Several bases, one front door" and "Many adapters, many workers".
"""

from serving.gateway.app import Gateway, build_gateway, serve_gateway, start_gateway
from serving.gateway.fleet import Choices, Fleet, WorkerView
from serving.gateway.forward import WORKER_HEADER

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
