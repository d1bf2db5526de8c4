"""A training model's requests, applied in the order its client numbered them (`seq_id`).

The SDK numbers every request of a training client from 1 and sends the chunks of one
forward/backward concurrently (the first chunk last, on purpose), so requests can arrive out
of order: each waits here until its predecessors have arrived. A new client of the same model
starts again from 1. A gap that stays open for `GAP_S` (a client died between reserving a
number and sending it) is skipped, so the model is not stuck forever.
"""

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from mint_core.tenancy import batch_shares
from trainer.wire import ForwardBackward

GAP_S = 30.0


class OpKind(StrEnum):
    FORWARD = "forward_backward"
    """`forward_backward` or `forward`: batched with other tenants'."""
    OPTIM = "optim_step"
    SAVE_STATE = "save_weights"
    LOAD_STATE = "load_weights"
    SAVE_SAMPLER = "save_weights_for_sampler"


@dataclass(frozen=True)
class Op:
    seq_id: int
    kind: OpKind
    request_id: str
    payload: object
    arrived: float = field(default_factory=time.monotonic)


class Sequencer:
    """The requests of one model that have arrived, released in `seq_id` order."""

    def __init__(self) -> None:
        self._waiting: dict[int, Op] = {}
        self._next = 1

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, op: Op) -> None:
        if op.seq_id < self._next:
            # A new client of this model (its numbers start again) or a retried send.
            self._next = op.seq_id
        self._waiting[op.seq_id] = op

    def ready(self, now: float | None = None) -> list[Op]:
        """The requests that may run now, in order (not removed: `take` does that)."""
        now = time.monotonic() if now is None else now
        if self._waiting and self._next not in self._waiting:
            oldest = min(op.arrived for op in self._waiting.values())
            if now - oldest > GAP_S:
                self._next = min(self._waiting)
        ops = []
        seq = self._next
        while seq in self._waiting:
            ops.append(self._waiting[seq])
            seq += 1
        return ops

    def take(self, ops: list[Op]) -> None:
        for op in ops:
            del self._waiting[op.seq_id]
            self._next = op.seq_id + 1

    def drain(self) -> list[Op]:
        """Every waiting request, removed (the model is going away)."""
        ops = sorted(self._waiting.values(), key=lambda op: op.seq_id)
        self._waiting.clear()
        return ops


def round_share(
    runs: Mapping[str, tuple[str, list[Op]]], weight: Callable[[str], float], pass_tokens: int
) -> dict[str, list[Op]]:
    """Of each model's ready forward/backward requests (model id -> its principal and them),
    those that go through the base this round: all of them, unless more than one principal
    wants more than a pass (`pass_tokens`) in all; then each principal's weighted max-min share
    of a pass (the tenancy file's weights, as in a serving batch), its first request whatever
    its size. The rest wait for the next round, so a tenant that sends many requests at once
    makes its own rounds longer, not everyone's."""
    wants: dict[str, int] = {}
    for principal, run in runs.values():
        wants[principal] = wants.get(principal, 0) + sum(_tokens(op) for op in run)
    if len(wants) < 2 or sum(wants.values()) <= pass_tokens:
        return {model_id: run for model_id, (_, run) in runs.items()}
    left = batch_shares(wants, weight, pass_tokens)
    shared = {}
    for model_id, (principal, run) in runs.items():
        shared[model_id] = []
        for op in run:
            if left[principal] <= 0:
                break
            left[principal] -= _tokens(op)
            shared[model_id].append(op)
    return shared


def _tokens(op: Op) -> int:
    assert isinstance(op.payload, ForwardBackward)
    return op.payload.tokens
