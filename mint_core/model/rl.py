"""GRPO on a LoRA with R3 routing replay and IcePop: the domain side of the `rl` flow.

A step takes groups of completions sampled for one prompt each (by a serving worker:
`tasks.rl.WorkerSampler`), scores them against the prompt's answer, turns each group's rewards
into advantages, and takes one policy-gradient step on the LoRA. On an MoE base the trainer
scores the completions with the sampler's expert routes replayed, and IcePop drops tokens
whose probability under trainer and sampler disagree too much.

On IcePop:

The sampler (a serving worker) and the trainer compute a token's probability with different
kernels, batches and, on MoE bases, possibly different experts; where the two disagree too much
the token's gradient is noise that can make training collapse. IcePop drops, per token, the
gradient of every token whose ratio π_train / π_sample lies outside [low, high] (the reference
uses [0.5, 5.0]), instead of clipping it as PPO would.
"""

import math
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from mint_core.distributed import Rank, World
from mint_core.errors import ConfigurationError
from mint_core.model.base import BaseModel, default_targets
from mint_core.model.experts import EXPERT_PARAMETERS, experts_modules
from mint_core.model.generate import seeded
from mint_core.model.rewards import Reward, char_reward, exact_reward
from mint_core.model.routing import flip_rate, moe_gates, recording_routes, replaying_routes
from mint_core.model.text import TextCodec
from mint_core.model.toy import (
    MIN_WORD_LENGTH,
    Example,
    Task,
    held_out_words,
    prompt_for,
    training_stream,
)
from mint_core.model.training import save_peft

ICEPOP_LOW = 0.5
"""Default lower bound of the kept ratio π_train / π_sample."""
ICEPOP_HIGH = 5.0
"""Default upper bound of the kept ratio π_train / π_sample."""


def icepop_mask(
    train_logprobs: torch.Tensor,
    sample_logprobs: torch.Tensor,
    low: float = ICEPOP_LOW,
    high: float = ICEPOP_HIGH,
) -> torch.Tensor:
    """True where the token's ratio exp(train - sample) lies in [low, high], bounds included.

    It compares in log space, log(low) <= train - sample <= log(high), in the log-probabilities'
    dtype, so that a ratio built from log-probabilities exactly at a bound counts as inside. A
    token the sampler gave -inf (an infinite ratio), or both gave -inf (NaN), is never kept.
    """
    if not 0 < low < high:  # also refuses NaN, which compares False
        raise ConfigurationError(
            f"IcePop bounds low={low}, high={high} must satisfy 0 < low < high (e.g. 0.5, 5.0)"
        )
    if train_logprobs.shape != sample_logprobs.shape:
        raise ConfigurationError(
            f"trainer log-probabilities of shape {tuple(train_logprobs.shape)} do not match the "
            f"sampler's {tuple(sample_logprobs.shape)}"
        )
    log_ratio = train_logprobs.detach() - sample_logprobs.detach()
    return (log_ratio >= math.log(low)) & (log_ratio <= math.log(high))


@dataclass(frozen=True)
class PolicyLoss:
    """One batch's policy-gradient loss and what IcePop did to it."""

    loss: torch.Tensor
    """Scalar to minimise: minus the mean of ratio * advantage over the kept tokens."""
    masked_fraction: float
    """The share of completion tokens IcePop dropped (logged per step)."""


def masked_policy_loss(
    train_logprobs: torch.Tensor,
    sample_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    low: float = ICEPOP_LOW,
    high: float = ICEPOP_HIGH,
    kept_total: int | None = None,
) -> PolicyLoss:
    """-mean(ratio * advantage) over the completion tokens IcePop keeps: over `kept_total` of
    them, when this batch is one rank's share of a step (default: the batch's own).

    `ratio = exp(train - sample)` with the sampler's log-probabilities constant, so its gradient
    is ratio * advantage * ∇ log π_train: the importance-weighted policy gradient for samples
    drawn from π_sample. `advantages` broadcasts against the log-probabilities (`[batch, 1]`
    for one advantage per completion); `completion_mask` marks the tokens that were sampled
    (not prompt or padding).
    """
    completion = completion_mask.bool()
    kept = icepop_mask(train_logprobs, sample_logprobs, low, high) & completion
    # Exponentiate only kept tokens: a dropped token's ratio may be inf, and inf * 0 is NaN.
    log_ratio = torch.where(kept, train_logprobs - sample_logprobs.detach(), 0.0)
    per_token = torch.exp(log_ratio) * advantages * kept
    count = kept.sum() if kept_total is None else torch.tensor(kept_total, device=kept.device)
    loss = -per_token.sum() / count.clamp(min=1)
    total = int(completion.sum())
    dropped = total - int(kept.sum())
    return PolicyLoss(loss=loss, masked_fraction=dropped / total if total else 0.0)


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """GRPO's advantages for `[prompts, group]` rewards: each completion's reward minus its
    group's mean, over the group's (population) standard deviation. A group whose completions
    all scored alike teaches nothing and gets zeros."""
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ConfigurationError(
            f"rewards of shape {tuple(rewards.shape)} are not [prompts, group] with a group of "
            "at least 2 completions per prompt; sample more completions per prompt"
        )
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    return centred / (rewards.std(dim=1, correction=0, keepdim=True) + 1e-6)


def k3_kl(train_logprobs: torch.Tensor, reference_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(π_train || π_ref) on tokens sampled from π_train:
    `exp(r) - r - 1` with `r = log π_ref - log π_train`; never negative, unbiased, and of lower
    variance than `-r` (Schulman's "Approximating KL divergence")."""
    log_ratio = reference_logprobs - train_logprobs
    return torch.exp(log_ratio) - log_ratio - 1


@dataclass(frozen=True)
class Sample:
    """One sampled completion, with what the sampler knew about it."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    """The sampled tokens, the end-of-sequence token included when the completion ended."""
    logprobs: tuple[float, ...]
    """The sampler's log-probability of each completion token (at temperature 1: π_sample)."""
    routes: torch.Tensor | None = None
    """`[len(prompt_ids) + len(completion_ids) - 1, layers, top_k]`: the experts each position
    the trainer feeds (the prompt and every completion token but the last) was routed to; None
    on a dense base or a sampler that does not record routes (no replay then)."""
    revision: str | None = None
    """The revision that sampled it (`name:rN`); None when the sampler does not say."""

    def __post_init__(self) -> None:
        if not self.prompt_ids or not self.completion_ids:
            raise ConfigurationError("a sample needs at least one prompt and one completion token")
        if len(self.logprobs) != len(self.completion_ids):
            raise ConfigurationError(
                f"a sample has {len(self.completion_ids)} completion tokens but "
                f"{len(self.logprobs)} log-probabilities; the sampler must give one per token"
            )
        fed = len(self.prompt_ids) + len(self.completion_ids) - 1
        if self.routes is not None and (self.routes.dim() != 3 or self.routes.shape[0] != fed):
            raise ConfigurationError(
                f"a sample's routes of shape {tuple(self.routes.shape)} do not cover the {fed} "
                "positions the trainer feeds ([prompt + completion - 1, layers, top_k])"
            )


@dataclass(frozen=True)
class Group:
    """The completions sampled for one prompt, and the answer they are scored against."""

    answer: str
    samples: tuple[Sample, ...]


class Sampler(Protocol):
    """Samples completions at temperature 1 with per-token log-probabilities (and routes on an
    MoE base), as a serving worker does (`tasks.rl.WorkerSampler`)."""

    def sample(self, prompt: str, n: int, max_new_tokens: int) -> list[Sample]:
        """`n` completions of one prompt (the base's codec encodes it, BOS included)."""
        ...


@dataclass(frozen=True)
class GrpoConfig:
    """How a GRPO run trains its LoRA."""

    rank: int = 8
    """LoRA rank r, on attention and (on an MoE base) on every expert."""
    alpha: int = 16
    """LoRA alpha; the update is scaled by alpha / rank."""
    learning_rate: float = 1e-3
    """Constant AdamW learning rate."""
    reward: Reward = Reward.CHARS
    """The reward advantages are computed from (exact match is always reported)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to the start in the loss; 0 only reports it."""
    icepop_low: float = ICEPOP_LOW
    icepop_high: float = ICEPOP_HIGH
    max_grad_norm: float = 1.0
    """Gradients are clipped to this global norm before each step."""
    expert_lora: bool = True
    """On an MoE base, also adapt the fused experts (`gate_up_proj`, `down_proj`)."""
    seed: int = 0
    """Seeds the LoRA's initialisation."""

    def __post_init__(self) -> None:
        if self.rank <= 0 or self.alpha <= 0:
            raise ConfigurationError(f"GRPO rank={self.rank} and alpha={self.alpha} must be > 0")
        if not (self.learning_rate > 0 and self.max_grad_norm > 0 and self.kl_coef >= 0):
            raise ConfigurationError(
                f"GRPO learning_rate={self.learning_rate} and max_grad_norm="
                f"{self.max_grad_norm} must be > 0, kl_coef={self.kl_coef} >= 0"
            )
        icepop_mask(torch.zeros(1), torch.zeros(1), self.icepop_low, self.icepop_high)

    def params(self) -> dict[str, str]:
        """Every hyperparameter as an MLflow param."""
        return {name: str(value) for name, value in asdict(self).items()}


@dataclass(frozen=True)
class StepMetrics:
    """What one GRPO step saw and did (the flow logs each as an MLflow metric)."""

    step: int
    reward: float
    """Mean training reward (`GrpoConfig.reward`) of the step's completions."""
    reward_exact: float
    """Share of the step's completions that are exactly the answer."""
    kl: float
    """Mean k3 KL to the start over the completion tokens, before the step."""
    masked_fraction: float
    """Share of completion tokens IcePop dropped."""
    flip_rate: float | None
    """Share of (completion token, layer) pairs whose top-k experts under the trainer, without
    replay, differ from the sampler's; None without routes."""
    loss: float

    def metrics(self) -> dict[str, float]:
        values = asdict(self)
        del values["step"]
        return {name: value for name, value in values.items() if value is not None}


@dataclass(frozen=True)
class _Batch:
    """A step's samples as right-padded tensors; position t predicts token t + 1."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    """The token each position predicts (0 where none)."""
    completion_mask: torch.Tensor
    """True at positions that predict a completion token."""
    sample_logprobs: torch.Tensor
    routes: torch.Tensor | None
    """`[batch, seq, layers, top_k]`, padding positions routed to experts 0..top_k-1."""


class GrpoTrainer:
    """A PeftModel on `base`, trained one GRPO step at a time: a fresh (zero) LoRA, or the
    adapter in the PEFT folder `start` (an SFT revision to improve; its own rank, alpha and
    targets then apply, not `config`'s). The KL reference is the start: the LoRA's weights as
    they were before the first step. `world`: the processes its steps run on (one, unless
    each is one rank's of a launch: `mint_core.model.rl_ranks`)."""

    def __init__(
        self,
        base: BaseModel,
        config: GrpoConfig,
        start: Path | None = None,
        world: World | None = None,
    ) -> None:
        self.base = base
        self.config = config
        self.world = world or World()
        self.steps = 0
        self.moe = bool(experts_modules(base.model))
        """Its base has experts: the sampler records routes for the trainer to replay."""
        self._start_dir = start
        if start is not None:
            self.model: PeftModel = PeftModel.from_pretrained(base.model, start, is_trainable=True)
        else:
            experts = [f"mlp.experts.{name}" for name in EXPERT_PARAMETERS]
            lora = LoraConfig(
                r=config.rank,
                lora_alpha=config.alpha,
                lora_dropout=0.0,  # PEFT refuses dropout on expert parameters
                target_modules=list(default_targets(base.model)),
                target_parameters=experts if self.moe and config.expert_lora else None,
                task_type="CAUSAL_LM",
            )
            with seeded(config.seed):
                self.model = get_peft_model(base.model, lora)
        self.model.train()
        self._trainable = [p for p in self.model.parameters() if p.requires_grad]
        self._start = [p.detach().clone() for p in self._trainable]
        self._optimizer = torch.optim.AdamW(self._trainable, lr=config.learning_rate)

    @property
    def lora(self) -> LoraConfig:
        """The LoRA being trained (a fresh one's, or the start adapter's)."""
        return self.model.peft_config["default"]

    @property
    def target_modules(self) -> tuple[str, ...]:
        return tuple(sorted(self.lora.target_modules))

    @property
    def target_parameters(self) -> tuple[str, ...]:
        return tuple(sorted(self.lora.target_parameters or ()))

    def step(self, groups: Sequence[Group], rank: Rank | None = None) -> StepMetrics:
        """Score `groups`, take one policy-gradient step, and report what it saw. With `rank`
        (every rank given every group) it feeds its share of whole groups, whose advantages
        are their own, and divides by the whole step's token counts, so that the gradients
        summed over the ranks are one process's on all groups; the figures are all groups'."""
        codec = self.base.codec
        rewards, exact = [], []
        for group in groups:
            scored = []
            for s in group.samples:
                text, finished = (
                    codec.decode(s.completion_ids),
                    s.completion_ids[-1] in codec.eos_ids,
                )
                scored.append(self.config.reward.score(group.answer, text, finished))
                exact.append(exact_reward(group.answer, text, finished))
            rewards.append(scored)
        if len({len(r) for r in rewards}) != 1:
            raise ConfigurationError(
                f"groups of sizes {sorted({len(r) for r in rewards})}; sample the same number "
                "of completions for every prompt"
            )
        reward_table = torch.tensor(rewards)
        advantages = group_advantages(reward_table)
        tokens = sum(len(s.completion_ids) for group in groups for s in group.samples)
        if rank is not None:
            if len(groups) < rank.size:
                raise ConfigurationError(
                    f"{len(groups)} prompts for {rank.size} training processes: each takes a "
                    f"share of the prompts; sample at least {rank.size} or use fewer processes"
                )
            mine = rank.shard(range(len(groups)))
            groups, advantages = [groups[i] for i in mine], advantages[mine]
        advantages = advantages.reshape(-1, 1).to(self.base.device)
        batch = self._batch([s for group in groups for s in group.samples])
        flips = self._flip_rate(batch)
        with torch.no_grad(), self._start_weights():
            reference = self._logprobs(batch)
        train = self._logprobs(batch)
        mask = batch.completion_mask
        low, high = self.config.icepop_low, self.config.icepop_high
        kept = int((icepop_mask(train, batch.sample_logprobs, low, high) & mask).sum())
        kept = int(_total(rank, kept))
        kl = (k3_kl(train, reference) * mask).sum() / tokens
        policy = masked_policy_loss(train, batch.sample_logprobs, advantages, mask, low, high, kept)
        loss = policy.loss + self.config.kl_coef * kl
        loss.backward()
        if rank is not None:
            rank.all_reduce_grads(self._trainable)
            if flips is not None:  # a mean over this rank's (token, layer) pairs
                pairs = int(mask.sum()) * batch.routes.shape[2]  # type: ignore[union-attr]
                flips = rank.sum(flips * pairs) / rank.sum(pairs)
        torch.nn.utils.clip_grad_norm_(self._trainable, self.config.max_grad_norm)
        self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return StepMetrics(
            step=self.steps,
            reward=reward_table.mean().item(),
            reward_exact=sum(exact) / len(exact),
            kl=_total(rank, kl.item()),
            masked_fraction=(tokens - kept) / tokens,
            flip_rate=flips,
            loss=_total(rank, loss.item()),
        )

    def save(self, out_dir: Path) -> Path:
        """The LoRA as a PEFT adapter directory (what the release pipeline freezes and packs).
        Before the first step that is the start adapter's own files: PEFT writes target_modules
        (a set) in this process's hash order, so saving it again would change its content
        digest."""
        if self._start_dir is not None and self.steps == 0:
            shutil.copytree(self._start_dir, out_dir, dirs_exist_ok=True)
        else:
            save_peft(self.model, out_dir, self.base.name_or_path)
        return out_dir

    @contextmanager
    def _start_weights(self) -> Iterator[None]:
        """The LoRA as it started, for the KL reference; its trained weights come back after."""
        trained = [p.detach().clone() for p in self._trainable]
        with torch.no_grad():
            for p, start in zip(self._trainable, self._start, strict=True):
                p.copy_(start)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, now in zip(self._trainable, trained, strict=True):
                    p.copy_(now)

    def _batch(self, samples: Sequence[Sample]) -> _Batch:
        with_routes = sum(s.routes is not None for s in samples)
        if with_routes not in (0, len(samples)):
            raise ConfigurationError(
                f"{with_routes} of {len(samples)} samples carry routes; replay needs all or none"
            )
        width = max(len(s.prompt_ids) + len(s.completion_ids) - 1 for s in samples)
        shape = (len(samples), width)
        input_ids = torch.full(shape, self.base.codec.pad_id)
        attention = torch.zeros(shape, dtype=torch.long)
        targets = torch.zeros(shape, dtype=torch.long)
        completion = torch.zeros(shape, dtype=torch.bool)
        sample_logprobs = torch.zeros(shape)
        routes = None
        if with_routes and self.moe:
            gate = moe_gates(self.base.model)
            # Padding needs valid, distinct experts; their outputs are masked out.
            routes = torch.arange(gate[0].top_k).expand(*shape, len(gate), -1).clone()
        for row, s in enumerate(samples):
            fed = (*s.prompt_ids, *s.completion_ids[:-1])
            start = len(s.prompt_ids) - 1
            input_ids[row, : len(fed)] = torch.tensor(fed)
            attention[row, : len(fed)] = 1
            targets[row, start : len(fed)] = torch.tensor(s.completion_ids)
            completion[row, start : len(fed)] = True
            sample_logprobs[row, start : len(fed)] = torch.tensor(s.logprobs)
            if routes is not None:
                assert s.routes is not None
                routes[row, : len(fed)] = s.routes
        device = self.base.device
        return _Batch(
            input_ids.to(device),
            attention.to(device),
            targets.to(device),
            completion.to(device),
            sample_logprobs.to(device),
            routes,
        )

    def _logprobs(self, batch: _Batch) -> torch.Tensor:
        """`[batch, seq]` log-probability of each target token, with the sampler's routes
        replayed when there are any."""
        if batch.routes is None:
            logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        else:
            with replaying_routes(self.model, batch.routes):
                logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        logprobs = torch.log_softmax(logits.logits.float(), dim=-1)
        return logprobs.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)

    @torch.no_grad()
    def _flip_rate(self, batch: _Batch) -> float | None:
        if batch.routes is None:
            return None
        with recording_routes(self.model) as own:
            self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        mask = batch.completion_mask.cpu()
        return flip_rate(own.indices[mask], batch.routes[mask])


def _total(rank: Rank | None, value: float) -> float:
    """`value` summed over the ranks (one process: itself)."""
    return value if rank is None else rank.sum(value)


def task_prompts(task: Task, seed: int, max_chars: int = 8) -> Iterator[Example]:
    """An endless, seeded stream of `task`'s prompts and answers for words of at most
    `max_chars` letters (never the held-out words)."""
    if max_chars < MIN_WORD_LENGTH:
        raise ConfigurationError(
            f"max_chars={max_chars}: no toy word is that short; give at least {MIN_WORD_LENGTH}"
        )
    return (e for e in training_stream(task, seed) if len(e.completion) <= max_chars)


def held_out_prompts(task: Task, max_chars: int = 8) -> list[Example]:
    """`task`'s held-out words of at most `max_chars` letters, as prompts and answers."""
    return [
        Example(prompt_for(word), task.answer(word))
        for word in held_out_words()
        if len(word) <= max_chars
    ]


def evaluate_sampled(
    sampler: Sampler, codec: TextCodec, examples: Sequence[Example], n: int
) -> tuple[float, float]:
    """(mean exact reward, mean character reward) of `n` completions sampled per example: the
    figures a GRPO step reports, on prompts it never trained on."""
    exact, chars = [], []
    for example in examples:
        for s in sampler.sample(example.prompt, n, answer_budget(codec, example.completion)):
            text = codec.decode(s.completion_ids)
            finished = s.completion_ids[-1] in codec.eos_ids
            exact.append(exact_reward(example.completion, text, finished))
            chars.append(char_reward(example.completion, text, finished))
    return sum(exact) / len(exact), sum(chars) / len(chars)


def answer_budget(codec: TextCodec, answer: str) -> int:
    """How many tokens a completion of `answer` may take: its tokens, end-of-sequence, and one
    spare (a completion cut off there scores 0)."""
    return len(codec.encode_answer(answer)) + 1
