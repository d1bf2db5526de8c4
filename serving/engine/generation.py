"""A generation in flight, whichever backend runs it: the tokens it produced so far, as events
a client reads while they come, and when it ends.

A backend pushes each token it samples (`Generating.push`); the request decides when the
generation ends, the same way on every backend: at one of the base's end-of-sequence ids, at a
stop string, or at `max_new_tokens`. Its tokens become text through the base's incremental
detokenizer, so the pieces its token events carry (one may be "" while a multi-byte character
is incomplete) add up to exactly its generation's text.
"""

import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from mint_core.access import ANONYMOUS
from mint_core.errors import ConfigurationError, MintError, ServiceError
from mint_core.model.base import BaseText
from mint_core.model.generate import FinishReason, Generation, Route
from mint_core.model.text import TextCodec
from serving.engine.sampling import RowSampler, SamplingParams, stop_hit


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    text: str
    """The text this token completes: "" while a multi-byte character is incomplete (or for
    an end-of-sequence token); the last token's also holds whatever the detokenizer held back.
    The pieces of a generation add up to its text."""
    logprob: float


class Generating:
    """One generation in flight; `result()` is the finished `Generation`. The scheduler thread
    writes it; the client reads its events."""

    def __init__(
        self,
        prompt_ids: list[int],
        key: str,
        params: SamplingParams,
        codec: TextCodec,
        warm_up: bool = False,
        principal: str = ANONYMOUS,
    ) -> None:
        self.prompt_ids = prompt_ids
        self.key = key
        """Engine key of the adapter serving it (BASE for the base)."""
        self.params = params
        self.warm_up = warm_up
        """A worker's own warm-up generation during prewarm, not a user's request."""
        self.principal = principal
        """Who asked: its place in the line is fair among principals."""
        self.sampler = RowSampler(params)
        self.eos_ids = (
            codec.eos_ids if params.stop_token_ids is None else frozenset(params.stop_token_ids)
        )
        self.detokenizer = codec.detokenizer()
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.routes: list[Route] = []
        """With `return_routes`: each token's route, as `push` got it."""
        self.prompt_routes: tuple[Route, ...] | None = None
        """With `return_routes`: the prompt's routes but the last position's, which the backend
        sets at prefill (see `Generation.prompt_routes`)."""
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None
        """perf_counter() at its first token: it waited in the queue (and prefilled) until
        then."""
        self.finish_reason: FinishReason | None = None
        self.failed = False
        self.joined_step: int | None = None
        """The scheduler step at which it joined the batch (prefill), and at which it left."""
        self.left_step: int | None = None
        self._events: queue.Queue[TokenEvent | Generation | MintError] = queue.Queue()
        self._cancelled = threading.Event()

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.failed or self._cancelled.is_set()

    def cancel(self) -> None:
        """The client went away: the scheduler drops the request at its next step."""
        self._cancelled.set()

    def events(self, timeout_s: float | None = None) -> Iterator[TokenEvent | Generation]:
        """Each token as it is generated, then the whole Generation. Raises what failed it."""
        while True:
            try:
                event = self._events.get(timeout=timeout_s)
            except queue.Empty:
                raise ServiceError(f"no token for {timeout_s} s; the engine is stuck") from None
            if isinstance(event, MintError):
                raise event
            yield event
            if isinstance(event, Generation):
                return

    def result(self, timeout_s: float | None = None) -> Generation:
        for event in self.events(timeout_s):
            if isinstance(event, Generation):
                return event
        raise AssertionError("events() ends with a Generation")

    # Called by the scheduler thread only.

    @property
    def text(self) -> str:
        """The text of the tokens so far (less what the detokenizer holds back)."""
        return self.detokenizer.text

    def push(self, token: int, logprob: float, route: Route | None = None) -> bool:
        """Record one generated token (with `return_routes`, its route: the experts each MoE
        layer routed the position that produced it to); True when it ends the generation."""
        if self.params.return_routes and (route is None or self.prompt_routes is None):
            raise ServiceError(
                f"token {len(self.token_ids)} of a generation that asked for its routes came "
                "without them; the backend does not record routes"
            )
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        if route is not None:
            self.routes.append(route)
        piece = self.detokenizer.push(token)
        if token in self.eos_ids:
            self.finish_reason = FinishReason.EOS_TOKEN
        elif stop_hit(self.text, self.params.stop):
            self.finish_reason = FinishReason.STOP_SEQUENCE
        elif len(self.token_ids) >= self.params.max_new_tokens:
            self.finish_reason = FinishReason.LENGTH
        if self.finish_reason is None:
            self._events.put(TokenEvent(token, piece, logprob))
            return False
        # The last event carries what was held back (a character cut short by the length
        # limit), so the streamed pieces add up to the generation's text.
        self._events.put(TokenEvent(token, piece + self.detokenizer.finish(), logprob))
        seed = None if self.params.greedy else self.sampler.seed
        generation = Generation(
            self.text,
            tuple(self.token_ids),
            tuple(self.logprobs),
            self.finish_reason,
            seed,
            tuple(self.routes) if self.params.return_routes else None,
            self.prompt_routes,
        )
        self._events.put(generation)
        return True

    def fail(self, error: MintError) -> None:
        self.failed = True
        self._events.put(error)


def check_prompt(text: BaseText, prompt_ids: Sequence[int], params: SamplingParams) -> None:
    """ConfigurationError unless the prompt is non-empty and fits the base's context together
    with the tokens it asks for. Both backends check this before anything runs."""
    if not prompt_ids:
        raise ConfigurationError(
            f"the prompt is empty: it has no tokens on the base model {text.model_id}; send "
            "some text"
        )
    if len(prompt_ids) + params.max_new_tokens > text.context_length:
        raise ConfigurationError(
            f"the prompt's {len(prompt_ids)} tokens plus max_new_tokens="
            f"{params.max_new_tokens} do not fit the context of the base model "
            f"{text.model_id} ({text.context_length} tokens); shorten the prompt or ask for "
            "fewer tokens"
        )
