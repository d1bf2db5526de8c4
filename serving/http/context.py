"""What every handler of the worker's API depends on: the worker, through the narrow
`WorkerAPI`; who calls (`Caller`, from the API key); the admin guard; and the life of a
generation request once routed (`Routed`: its headers, its outcome, its stream).

`create_app` keeps the worker and the API keys in the app's state; handlers get them through
FastAPI dependencies, so each router is a module-level `APIRouter` that holds no worker.
"""

import logging
import time
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Annotated, Protocol

from fastapi import Depends, Header, Request
from fastapi.responses import StreamingResponse

from mint_core.access import ANONYMOUS, check_admin, principal_of_header
from mint_core.alias_intents import HeldMove
from mint_core.errors import AuthenticationError, MintError, RateLimitedError
from mint_core.model.base import BaseText
from mint_core.model.text import TextCodec
from mint_core.planning.admission import Priority
from mint_core.revisions import RevisionId, RevisionRef
from mint_core.tenancy import Admitted, Limiter
from serving.engine.generation import Generating
from serving.engine.sampling import SamplingParams
from serving.http.common import BASE_NAMES, REQUEST_ID_HEADER, REVISION_HEADER, sse
from serving.http.errors import error_response
from serving.worker.leaving import Drain
from serving.worker.outcomes import Outcomes, Usage
from serving.worker.readiness import AliasEvent, ReadinessEntry, Residence

log = logging.getLogger(__name__)


class WorkerAPI(Protocol):
    """What the HTTP layer asks of a worker (`serving.worker.worker.Worker`), and nothing more."""

    outcomes: Outcomes

    @property
    def base(self) -> BaseText: ...
    @property
    def codec(self) -> TextCodec: ...
    @property
    def degraded(self) -> str | None: ...
    @property
    def last_sync(self) -> float | None: ...
    @property
    def backend_kind(self) -> str: ...
    @property
    def queue_depth(self) -> int: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def request_path_loads(self) -> int: ...
    @property
    def held_moves(self) -> list[HeldMove]: ...

    def route(
        self, ref: RevisionRef | None, principal: str, admin: bool
    ) -> tuple[RevisionId | None, str]: ...
    def generate(
        self,
        prompt_ids: list[int],
        key: str,
        params: SamplingParams,
        *,
        streamed: bool,
        principal: str,
    ) -> Generating: ...
    def ready_revisions(self, principal: str) -> list[RevisionId]: ...
    def adapter_status(
        self, adapter: str, principal: str, sees_all: bool
    ) -> list[tuple[ReadinessEntry, Residence]]: ...
    def admit_known(self, revision: RevisionId, priority: Priority) -> ReadinessEntry: ...
    def sync(self) -> list[RevisionId]: ...
    def routing(self) -> tuple[list[RevisionId], list[str]]: ...
    def events(self) -> list[ReadinessEntry]: ...
    def alias_events(self) -> list[AliasEvent]: ...
    def exposition(self) -> bytes: ...


@dataclass(frozen=True)
class Access:
    """Who may call: API key -> principal (none: everyone is anonymous, the header ignored),
    and the principals that are admins."""

    keys: Mapping[str, str]
    admins: Collection[str]

    def principal(self, authorization: str | None) -> str:
        return principal_of_header(self.keys, authorization)

    def is_admin(self, principal: str) -> bool:
        """Whether `principal` sees and uses every revision: an admin of a worker with keys.
        (Without keys there is no telling callers apart: none is.)"""
        return bool(self.keys) and principal in self.admins


@dataclass(frozen=True)
class Caller:
    """One request's caller and the worker that answers it."""

    worker: WorkerAPI
    principal: str
    admin: bool
    open_worker: bool
    """The worker has no API keys: every endpoint is open to all, as before keys existed."""
    limiter: Limiter
    """The principals' quotas on this worker."""


def worker_of(request: Request) -> WorkerAPI:
    return request.app.state.worker


def access_of(request: Request) -> Access:
    return request.app.state.access


# The dependencies are coroutines, though they never await: FastAPI runs a plain function
# dependency on a thread of its pool, a hop (two thread wake-ups) per request for a dict lookup.
async def current_caller(
    request: Request, authorization: Annotated[str | None, Header()] = None
) -> Caller:
    access = access_of(request)
    who = access.principal(authorization)
    limiter = request.app.state.limiter
    return Caller(worker_of(request), who, access.is_admin(who), not access.keys, limiter)


async def _worker(request: Request) -> WorkerAPI:
    return worker_of(request)


async def _drain(request: Request) -> Drain:
    return request.app.state.drain


CurrentCaller = Annotated[Caller, Depends(current_caller)]
CurrentWorker = Annotated[WorkerAPI, Depends(_worker)]
CurrentDrain = Annotated[Drain, Depends(_drain)]
"""The worker process's departure: whether it is leaving (`serving.worker.leaving`)."""


async def admin_only(request: Request, caller: CurrentCaller) -> None:
    """Every route under /admin depends on this: with API keys, only admin principals."""
    if caller.open_worker:
        return
    if caller.principal == ANONYMOUS:
        raise AuthenticationError(
            f"{request.method} {request.url.path} needs an admin key of this worker; send "
            "'Authorization: Bearer <key>' with a key whose principal is in "
            "MINT_ADMIN_PRINCIPALS"
        )
    check_admin(caller.principal, access_of(request).admins)


@dataclass(frozen=True)
class Routed:
    """A generation request once routed and let in by its principal's quota: what serves it,
    for its whole life."""

    worker: WorkerAPI
    served: str
    """The exact revision, or the base's model id."""
    key: str
    """Its engine key."""
    request_id: str
    principal: str
    prompt_tokens: int
    admitted: Admitted
    """What its principal's quota let in; it pays the generated tokens when it ends."""
    at: float
    """perf_counter() when it was routed: its latency counts from here."""
    started: list[Generating] = field(default_factory=list)
    """Its generations (a completion of several prompts has one each)."""

    @property
    def headers(self) -> dict[str, str]:
        return {REVISION_HEADER: self.served, REQUEST_ID_HEADER: self.request_id}

    def generate(self, prompt_ids: list[int], params: SamplingParams, streamed: bool) -> Generating:
        """Start one of its generations on the worker, in its principal's fair share."""
        generating = self.worker.generate(
            prompt_ids, self.key, params, streamed=streamed, principal=self.principal
        )
        self.started.append(generating)
        return generating

    def finished(self, error: Exception | None) -> None:
        """Record the response's outcome and usage (its latency, tokens, time in queue, and
        whether it failed on the worker's side: a refusal of the request itself, 4xx, is the
        caller's), and pay its generated tokens to its principal's quota."""
        failed = error is not None and error_response(error).status >= 500
        generated = sum(len(g.token_ids) for g in self.started)
        queued = [g.first_token_at - g.submitted for g in self.started if g.first_token_at]
        self.admitted.finished(generated)
        self.worker.outcomes.finished(
            self.served,
            time.perf_counter() - self.at,
            failed,
            Usage(
                prompt_tokens=self.prompt_tokens,
                generated_tokens=generated,
                queue_s=max(queued, default=0.0),
            ),
            self.principal,
        )

    @contextmanager
    def recorded(self, streaming: bool = False) -> Iterator[None]:
        """Around the work of a response: records its outcome if it fails here, or when it
        ends here (a stream that starts records its own end)."""
        try:
            yield
        except Exception as e:
            self.finished(e)
            raise
        if not streaming:
            self.finished(None)

    def stream(self, events: Iterator[str], generating: Generating) -> StreamingResponse:
        """A protocol's events of `generating` as they come; an error after the response has
        started is its last event."""

        def body() -> Iterator[str]:
            error = None
            try:
                yield from events
            except Exception as e:
                if not isinstance(e, MintError):
                    # The server never sees it: log it here.
                    log.exception("stream from %s failed", self.served)
                error = e
                yield sse(error_response(e).body)
            finally:
                generating.cancel()  # a no-op once finished; frees the row if the client left
                self.finished(error)

        return StreamingResponse(body(), media_type="text/event-stream", headers=self.headers)


def route(caller: Caller, model: str | None, kind: str, prompt_tokens: int) -> Routed:
    """Route `model` (a revision reference, or none/the base id for the base) through the
    readiness gate, once for the whole request, let it in by its principal's quota
    (RateLimitedError if over it), and give the response its request id (`<kind>-<hex>`).
    `prompt_tokens`: all its prompts' tokens, which the quota counts at once."""
    worker = caller.worker
    base_names = (*BASE_NAMES, worker.base.model_id)
    ref = None if model in base_names else RevisionRef.parse(str(model))
    revision, key = worker.route(ref, caller.principal, admin=caller.admin)
    served = str(revision) if revision else worker.base.model_id
    try:
        admitted = caller.limiter.admit(caller.principal, prompt_tokens)
    except RateLimitedError:
        worker.outcomes.refused(served, caller.principal)
        raise
    request_id = worker.outcomes.started(served, caller.principal, kind)
    return Routed(
        worker,
        served,
        key,
        request_id,
        caller.principal,
        prompt_tokens,
        admitted,
        time.perf_counter(),
    )
