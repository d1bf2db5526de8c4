"""Continuous batching: one thread runs the engine step after step; requests join the running
batch at any step and leave it as soon as they finish.

Each step retires the rows that finished, failed or lost their client, lets waiting requests
join while the batch has room (in fair-share order among principals, each within its share of
the rows: `mint_core.tenancy`; each with its adapter pinned in a device slot, at most one copy
from the host per step), and decodes one token for every running row in one forward pass. Rows
never mix: each computes what it would alone, and a failure fails its own request, or a step's
requests, never the loop. The steps, the key/value cache and text: the README, "Running the
pieces".
"""

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mint_core.access import ANONYMOUS
from mint_core.config import MintConfig
from mint_core.errors import (
    ConfigurationError,
    IntegrityError,
    MintError,
    NotReadyError,
    ServiceError,
)
from mint_core.model.generate import Route, pad_left
from mint_core.planning.residency import Residency, SlotGrant
from mint_core.tenancy import RETURNING_S, FairQueue, batch_shares
from serving.engine.engine import BASE, AdapterWeights, TorchEngine
from serving.engine.generation import Generating, check_prompt
from serving.engine.sampling import SamplingParams
from serving.metrics import WorkerMetrics

log = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = MintConfig.max_batch
KVCache = list[tuple[torch.Tensor, torch.Tensor]]


class Scheduler:
    """Runs the engine for every request of one worker."""

    def __init__(
        self,
        engine: TorchEngine,
        residency: Residency[AdapterWeights],
        metrics: WorkerMetrics,
        max_batch: int = DEFAULT_MAX_BATCH,
        weight: Callable[[str], float] = lambda _: 1.0,
    ) -> None:
        if max_batch < 1:
            raise ConfigurationError(f"max_batch={max_batch} must be at least 1")
        self.engine = engine
        self.residency = residency
        """The tiers; its host cache holds the weights a slot copy reads."""
        self.metrics = metrics
        self.max_batch = max_batch
        self._weight = weight
        self._waiting: FairQueue[Generating] = FairQueue(weight)
        """Requests waiting to join, in fair-share order among principals (`weight`: each
        one's share; `mint_core.tenancy`)."""
        self._wake = threading.Condition()
        self._running: list[Generating] = []
        self._ended: dict[str, float] = {}
        """Principals whose request ended within RETURNING_S, and when (their next is due)."""
        self._joining: list[Generating] = []
        """Requests taken from the queue for the next prefill (each pinning its slot)."""
        self._cache: KVCache | None = None
        self._mask: torch.Tensor | None = None
        self._stopped = False
        self.steps = 0
        """Forward passes run so far (prefills and decode steps)."""
        self.request_path_loads = 0
        """Adapters copied into a device slot for a user's request (not a warm-up): the request
        waited for the copy. Happens when more adapters are in use than there are slots."""
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self._thread.start()

    def submit(
        self,
        prompt_ids: list[int],
        key: str,
        params: SamplingParams,
        warm_up: bool = False,
        principal: str = ANONYMOUS,
    ) -> Generating:
        """Queue a generation of `principal`'s; its adapter must be in the host cache (ready)
        or BASE. `warm_up` marks a worker's own prewarm generation. Its place in the line is
        fair among principals, costing its prompt and `max_new_tokens`."""
        check_prompt(self.engine.base.text, prompt_ids, params)
        if params.return_routes:
            self.engine.check_routes()
        request = Generating(prompt_ids, key, params, self.engine.codec, warm_up, principal)
        with self._wake:
            if self._stopped:
                raise ServiceError("the scheduler is stopped")
            self._waiting.push(request, principal, len(prompt_ids) + params.max_new_tokens)
            self.metrics.queue_depth.set(len(self._waiting))
            self._wake.notify()
        return request

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def batch_size(self) -> int:
        return len(self._running)

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopped and not self._waiting and not self._running:
                    self._wake.wait()
                if self._stopped:
                    break
            try:
                self._retire()
                self._join()
                self._retire()
                if self._running:
                    self._decode()
                elif self._waiting:
                    # Every waiting request waits for a slot that a running one will free:
                    # none is running, so nothing changes until something new arrives.
                    time.sleep(0.001)
            except Exception as e:  # the loop must outlive any one bad step
                log.exception("scheduler step failed; failing its requests")
                self._fail_step(ServiceError(f"the engine failed a step: {type(e).__name__}: {e}"))
        for request in [*self._running, *self._joining, *self._waiting.ordered()]:
            request.fail(ServiceError("the worker is shutting down"))

    def _fail_step(self, error: MintError) -> None:
        """Answer every request of a failed step, running or joining, with `error`, and drop
        them all (with the batch's cache, which the step may have left half updated)."""
        # Joiners pin slots too: retiring unpins them (a failed merge may have added them).
        self._running += [r for r in self._joining if r not in self._running]
        self._joining = []
        for request in self._running:
            if not request.done:
                request.fail(error)
        self._retire()

    def _retire(self) -> None:
        keep = [i for i, r in enumerate(self._running) if not r.done]
        if len(keep) == len(self._running):
            return
        for request in self._running:
            if not request.done:
                continue
            request.left_step = self.steps
            self._ended[request.principal] = time.monotonic()
            if request.key != BASE and self.residency.release(request.key):
                self.engine.unload(request.key)  # unloaded while it ran: gone now
            if request.finish_reason is not None:
                self.metrics.finished(request)
        self._running = [self._running[i] for i in keep]
        if not keep:
            self._cache = self._mask = None
            return
        assert self._cache is not None and self._mask is not None
        rows = torch.tensor(keep, device=self._mask.device)
        mask = self._mask.index_select(0, rows)
        # Drop leading columns that are padding in every remaining row.
        first = int(mask.any(0).nonzero()[0])
        self._mask = mask[:, first:]
        self._cache = [
            (k.index_select(0, rows)[:, :, first:], v.index_select(0, rows)[:, :, first:])
            for k, v in self._cache
        ]

    def _join(self) -> None:
        joining = self._joining
        copied = False
        with self._wake:
            candidates = self._waiting.ordered()
        shares = self._shares(candidates) if candidates else {}
        holding = Counter(r.principal for r in [*self._running, *joining])
        for request in candidates:
            if len(self._running) + len(joining) >= self.max_batch:
                break
            if request.done:
                self._unqueue(request, joined=False)
                continue
            if holding[request.principal] >= shares[request.principal]:
                continue  # its share of the rows is full while others want theirs
            grant: SlotGrant | None = None
            if request.key != BASE:
                if copied and self.residency.slot_of(request.key) is None:
                    continue  # one copy per step
                try:
                    grant = self.residency.acquire(request.key, use=not request.warm_up)
                except NotReadyError as e:  # evicted from the host cache since it was routed
                    self._unqueue(request, joined=False)
                    request.fail(e)
                    continue
                if grant is None:
                    continue  # every slot pinned: wait for one to be released
            self._unqueue(request, joined=True)
            holding[request.principal] += 1
            joining.append(request)  # from here a failed step answers it and unpins its slot
            if grant is not None and grant.load:
                try:
                    self.engine.load(self.residency.host_weights(request.key), grant.slot)
                except MintError as e:
                    joining.remove(request)
                    if self.residency.release(request.key):
                        self.engine.unload(request.key)
                    request.fail(NotReadyError(f"{request.key} could not be loaded: {e}"))
                    continue
                copied = True
                if not request.warm_up:
                    self.request_path_loads += 1
        if not joining:
            return
        input_ids, mask = pad_left([r.prompt_ids for r in joining], self.engine.codec.pad_id)
        input_ids, mask = input_ids.to(self.engine.device), mask.to(self.engine.device)
        slots = [self.engine.slot_of(r.key) for r in joining]
        logits, cache, routes = self.engine.step(
            input_ids, mask, slots, None, _wants_routes(joining)
        )
        self.steps += 1
        for row, request in enumerate(joining):
            request.joined_step = self.steps
            self.metrics.first_token(request)
            if routes is not None and request.params.return_routes:
                # Left padding: the row's prompt is its last len(prompt_ids) positions, and the
                # last of them produced the first token (its route goes with that token).
                prompt = routes[row, mask.shape[1] - len(request.prompt_ids) : -1]
                request.prompt_routes = tuple(map(_route, prompt))
        self._sample(joining, logits, routes)
        self._merge(joining, cache, mask)
        self._joining = []

    def _shares(self, candidates: list[Generating]) -> dict[str, int]:
        """Each principal's rows of the batch (`batch_shares`): by what it runs and waits for,
        and a row for each whose request just ended (its next one is on its way)."""
        now = time.monotonic()
        wants = Counter(r.principal for r in [*self._running, *self._joining, *candidates])
        for principal, ended in list(self._ended.items()):
            if now - ended > RETURNING_S:
                del self._ended[principal]
            elif principal not in wants:
                wants[principal] = 1
        return batch_shares(wants, self._weight, self.max_batch)

    def _unqueue(self, request: Generating, joined: bool) -> None:
        """`request` leaves the line: it `joined` the batch (its principal's turn is taken), or
        ended without (cancelled, its adapter gone)."""
        with self._wake:
            if joined:
                self._waiting.take(request)
            else:
                self._waiting.drop(request)
            self.metrics.queue_depth.set(len(self._waiting))

    def _merge(self, joining: list[Generating], cache: KVCache, mask: torch.Tensor) -> None:
        """Append the joiners' rows to the running batch, left-padding to one width."""
        if self._cache is None or self._mask is None:
            self._running, self._cache, self._mask = joining, cache, mask
            return
        width = max(self._mask.shape[1], mask.shape[1])

        def widen(t: torch.Tensor, dim: int) -> torch.Tensor:
            missing = width - t.shape[dim]
            if missing == 0:
                return t
            pad = [0, 0] * (t.dim() - 1 - dim) + [missing, 0]
            return F.pad(t, pad)

        self._running = self._running + joining
        self._mask = torch.cat([widen(self._mask, 1), widen(mask, 1)])
        self._cache = [
            (torch.cat([widen(k, 2), widen(jk, 2)]), torch.cat([widen(v, 2), widen(jv, 2)]))
            for (k, v), (jk, jv) in zip(self._cache, cache, strict=True)
        ]

    def _decode(self) -> None:
        assert self._mask is not None
        started = time.perf_counter()
        input_ids = torch.tensor(
            [[r.token_ids[-1]] for r in self._running], device=self.engine.device
        )
        mask = F.pad(self._mask, (0, 1), value=1)
        slots = [self.engine.slot_of(r.key) for r in self._running]
        logits, self._cache, routes = self.engine.step(
            input_ids, mask, slots, self._cache, _wants_routes(self._running)
        )
        self.steps += 1
        self._mask = mask
        self._sample(self._running, logits, routes)
        rows = len(self._running)
        self.metrics.batch_size.observe(rows)
        self.metrics.tokens_per_second.set(rows / (time.perf_counter() - started))

    def _sample(
        self, requests: list[Generating], logits: torch.Tensor, routes: torch.Tensor | None
    ) -> None:
        """Each row's next token from its last position's `logits`; `routes` (`[batch, new,
        layers, top_k]`, when recorded) gives each token the route of that position."""
        finite = torch.isfinite(logits).all(dim=-1).tolist()
        last = [None] * len(requests) if routes is None else routes[:, -1]
        for request, row, row_is_finite, position in zip(
            requests, logits, finite, last, strict=True
        ):
            if request.done:
                continue
            if not row_is_finite:
                request.fail(
                    IntegrityError(
                        f"{request.key} produced non-finite logits (NaN or infinity): its "
                        "weights on this worker are damaged, so no token was sampled; admit the "
                        "revision again to reload it from its artifact"
                    )
                )
                continue
            try:
                token, logprob = request.sampler.pick(row)
            except RuntimeError as e:  # one request's sampling parameters fail it alone
                request.fail(ServiceError(f"sampling for {request.key} failed: {e}"))
                continue
            with_route = position is not None and request.params.return_routes
            request.push(token, logprob, _route(position) if with_route else None)
        self.metrics.generated_tokens.inc(len(requests))


def _wants_routes(requests: list[Generating]) -> bool:
    """Whether a step records routes: only when one of its rows asked (it costs hooks)."""
    return any(r.params.return_routes for r in requests)


def _route(position: torch.Tensor) -> Route:
    """One position's `[layers, top_k]` expert indices as plain integers."""
    return tuple(map(tuple, position.tolist()))
