"""One forward (and backward) pass over the resident base for many tenants' requests at once.

The rows of every forward/backward request that may run now, whoever sent it, are packed into
passes of at most `batch_tokens` tokens (rows x longest row, right-padded), each tenant's rows
contiguous so the LoRA wrappers add each tenant's delta to its own rows only. Each row's loss is
its request's loss function on the log-probabilities of its target tokens; the losses of rows
that train are summed and backpropagated once: each tenant's parameters get the gradient of
their own rows, added to what they hold (gradients accumulate until the optimizer step). A
request split across passes adds up the same, its loss being a sum.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from mint_core.errors import ConfigurationError
from trainer.lora import Router, Segment, TenantLora
from trainer.losses import check_inputs, loss_named, token_logprobs
from trainer.wire import Datum, ForwardBackward


@dataclass
class Work:
    """One forward/backward request and what its passes have found so far."""

    request: ForwardBackward
    lora: TenantLora
    outputs: list[dict[str, np.ndarray] | None] = field(default_factory=list)
    loss: float = 0.0

    def __post_init__(self) -> None:
        self.outputs = [None] * len(self.request.data)


def check_request(request: ForwardBackward, vocab: int, context: int) -> None:
    """ConfigurationError naming what makes `request` one the base cannot run."""
    loss_named(request.loss_fn).check_config(request.loss_fn_config)
    if not request.data:
        raise ConfigurationError("forward_backward has no data; send at least one Datum")
    for i, datum in enumerate(request.data):
        length = len(datum.tokens)
        if length == 0:
            raise ConfigurationError(f"datum {i} has no input tokens")
        if length > context:
            raise ConfigurationError(
                f"datum {i} has {length} tokens, more than the base's context of {context}; "
                "shorten it"
            )
        check_inputs(request.loss_fn, datum.inputs, i)
        for name, values in datum.inputs.items():
            if len(values) != length:
                raise ConfigurationError(
                    f"datum {i}: loss_fn_inputs[{name!r}] has {len(values)} values for {length} "
                    "input tokens; every loss input has one value per input position"
                )
            if values.dtype.kind == "f" and not np.isfinite(values).all():
                bad = values[~np.isfinite(values)][0]
                raise ConfigurationError(
                    f"datum {i}: loss_fn_inputs[{name!r}] holds {bad}; every value must be a "
                    "finite number"
                )
        targets = datum.inputs["target_tokens"]
        if targets.dtype.kind == "f" and (fractional := np.rint(targets) != targets).any():
            raise ConfigurationError(
                f"datum {i}: target_tokens holds {targets[fractional][0]}, not a token id; token "
                "ids are whole numbers"
            )
        for name, ids in (
            ("model_input", datum.tokens),
            ("target_tokens", datum.inputs["target_tokens"]),
        ):
            ids = np.asarray(ids)
            if ids.size and (ids.min() < 0 or ids.max() >= vocab):
                bad = int(ids[(ids < 0) | (ids >= vocab)][0])
                raise ConfigurationError(
                    f"datum {i}: {name} holds token {bad}, outside the base's vocabulary of "
                    f"{vocab} tokens (0..{vocab - 1}); tokenize with the base's own tokenizer "
                    "(get_info().model_data.tokenizer_id)"
                )


@dataclass(frozen=True)
class _Row:
    work: Work
    index: int

    @property
    def datum(self) -> Datum:
        return self.work.request.data[self.index]


def plan_passes(works: Sequence[Work], batch_tokens: int) -> list[list[_Row]]:
    """The rows of `works`, grouped by tenant (in the order their works come), cut into passes
    of at most `batch_tokens` padded tokens (a row longer than that runs alone)."""
    order: dict[int, list[_Row]] = {}
    for work in works:
        order.setdefault(id(work.lora), []).extend(
            _Row(work, i) for i in range(len(work.request.data))
        )
    rows = [row for group in order.values() for row in group]
    passes: list[list[_Row]] = []
    current: list[_Row] = []
    longest = 0
    for row in rows:
        length = len(row.datum.tokens)
        if current and max(longest, length) * (len(current) + 1) > batch_tokens:
            passes.append(current)
            current, longest = [], 0
        current.append(row)
        longest = max(longest, length)
    if current:
        passes.append(current)
    return passes


def run_pass(
    model: torch.nn.Module,
    router: Router,
    rows: list[_Row],
    pad_id: int,
    device: torch.device,
    before: Callable[[], None] = lambda: None,
) -> None:
    """Forward the rows (and backward the losses of those that train); each row's outputs and
    loss go to its work. The losses run per request kind over padded rows (the mask drops the
    padding's positions: zero inputs do not zero every loss there)."""
    longest = max(len(row.datum.tokens) for row in rows)
    input_ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    targets = torch.zeros((len(rows), longest), dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row.datum.tokens)
        input_ids[i, :n] = torch.from_numpy(row.datum.tokens)
        targets[i, :n] = torch.from_numpy(row.datum.inputs["target_tokens"].astype(np.int64))
        mask[i, :n] = 1
    trains = any(not row.work.request.forward_only for row in rows)
    before()
    with torch.set_grad_enabled(trains):
        with router.rows(_segments(rows)):
            logits = model(input_ids=input_ids.to(device), attention_mask=mask.to(device)).logits
        logprobs = token_logprobs(logits, targets.to(device))  # [rows, longest]
        total: torch.Tensor | None = None
        for (loss_fn, _), group in _by_loss(rows).items():
            request = group[0][1].work.request
            index = torch.tensor([i for i, _ in group], device=device)
            inputs = _padded_inputs([row for _, row in group], longest, loss_fn, device)
            result = loss_named(loss_fn).fn(logprobs[index], inputs, request.loss_fn_config)
            losses = (result.elementwise * mask[index].to(device)).sum(-1)
            for j, (_, row) in enumerate(group):
                n = len(row.datum.tokens)
                row.work.outputs[row.index] = {
                    name: value[j, :n].float().cpu().numpy()
                    for name, value in result.outputs.items()
                }
                row.work.loss += float(losses[j].detach())
                if not row.work.request.forward_only:
                    total = losses[j] if total is None else total + losses[j]
    if total is not None and total.requires_grad:
        total.backward()


def _by_loss(rows: list[_Row]) -> dict[tuple[str, str], list[tuple[int, _Row]]]:
    """The rows (with their place in the pass) by loss function and its configuration."""
    groups: dict[tuple[str, str], list[tuple[int, _Row]]] = {}
    for i, row in enumerate(rows):
        request = row.work.request
        key = (request.loss_fn, repr(sorted(request.loss_fn_config.items())))
        groups.setdefault(key, []).append((i, row))
    return groups


def _padded_inputs(
    rows: list[_Row], longest: int, loss_fn: str, device: torch.device
) -> dict[str, torch.Tensor]:
    """Each loss input but the targets as `[rows, longest]` float32, zero past a row's end (a
    row without an optional input gets its default)."""
    defaults = loss_named(loss_fn).defaults
    names = {name for row in rows for name in row.datum.inputs} - {"target_tokens"}
    padded = {name: np.zeros((len(rows), longest), np.float32) for name in names}
    for i, row in enumerate(rows):
        n = len(row.datum.tokens)
        for name in names:
            values = row.datum.inputs.get(name)
            padded[name][i, :n] = defaults[name] if values is None else values
    return {name: torch.from_numpy(array).to(device) for name, array in padded.items()}


def _segments(rows: list[_Row]) -> tuple[Segment, ...]:
    segments: list[Segment] = []
    start = 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i].work.lora is not rows[start].work.lora:
            segments.append(Segment(start, i, rows[start].work.lora))
            start = i
    return tuple(segments)
