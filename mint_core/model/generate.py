"""Greedy decoding of a batch with Hugging Face `generate`: evaluation during training and the
engine's static batches (tests, benchmarks). The serving scheduler decodes step by step itself
and shares only `FinishReason`, `Generation` and `pad_left` with this module."""

import contextlib
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch
from torch import nn

from mint_core.model.text import TextCodec


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run a block under a fixed torch and `random` seed, then restore the outer RNG state."""
    torch_state = torch.random.get_rng_state()
    python_state = random.getstate()
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        yield
    finally:
        torch.random.set_rng_state(torch_state)
        random.setstate(python_state)


class FinishReason(StrEnum):
    """Why a generation ended (TGI's names)."""

    LENGTH = "length"
    """It reached max_new_tokens."""
    EOS_TOKEN = "eos_token"
    """The model emitted one of its end-of-sequence tokens."""
    STOP_SEQUENCE = "stop_sequence"
    """Its text ended with one of the request's stop sequences."""


Route = tuple[tuple[int, ...], ...]
"""The experts each MoE layer routed one position to: `[layers][top_k]` expert indices."""


@dataclass(frozen=True)
class Generation:
    """One row's continuation."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    """Log-probability of each generated token under the model that produced it."""
    finish_reason: FinishReason
    seed: int | None = None
    """The sampling seed, when the tokens were sampled."""
    routes: tuple[Route, ...] | None = None
    """When asked for (R3): per generated token, the route of the position that produced it
    (the prompt's last position for the first token, then each generated token but the last)."""
    prompt_routes: tuple[Route, ...] | None = None
    """With `routes`: the route of each prompt position but the last, so that `prompt_routes +
    routes` covers exactly what a trainer feeds to score the tokens (prompt + tokens[:-1])."""

    @property
    def finished(self) -> bool:
        """True when the generation ended by itself, not at the length limit."""
        return self.finish_reason is not FinishReason.LENGTH


def pad_left(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id rows padded on the left to one width, and their attention mask."""
    width = max(len(ids) for ids in rows)
    input_ids = torch.full((len(rows), width), pad_id)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for row, ids in enumerate(rows):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention_mask[row, width - len(ids) :] = 1
    return input_ids, attention_mask


@torch.inference_mode()
def greedy_generate(
    model: nn.Module,
    codec: TextCodec,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    **forward_kwargs: object,
) -> list[Generation]:
    """Greedy-decode a batch of token id prompts (left-padded). Extra kwargs reach `generate`,
    e.g. PEFT's `adapter_names` for a batch that mixes adapters row by row."""
    input_ids, attention_mask = pad_left(prompts, codec.pad_id)
    device = next(model.parameters()).device
    width = input_ids.shape[1]
    output = model.generate(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=sorted(codec.eos_ids),
        pad_token_id=codec.pad_id,
        output_scores=True,
        return_dict_in_generate=True,
        **forward_kwargs,
    )
    new_tokens = output.sequences[:, width:]
    step_logprobs = torch.stack([torch.log_softmax(s.float(), dim=-1) for s in output.scores], 1)
    results = []
    for row in range(len(prompts)):
        ids: list[int] = []
        logprobs: list[float] = []
        reason = FinishReason.LENGTH
        for step, token in enumerate(new_tokens[row].tolist()):
            ids.append(token)
            logprobs.append(step_logprobs[row, step, token].item())
            if token in codec.eos_ids:
                reason = FinishReason.EOS_TOKEN
                break
        results.append(Generation(codec.decode(ids), tuple(ids), tuple(logprobs), reason))
    return results
