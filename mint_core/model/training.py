"""LoRA training with PEFT on the user's data: the `train` step of the release pipeline.

The base is loaded for training in this process (never a copy of a serving base: at 30B there
is no room for one). Rows are shuffled each epoch from the seed; each optimizer step reports
its loss to `on_step` (the pipeline logs it to MLflow and draws the CLI's progress bar). Only
the adapter, a PEFT adapter directory, leaves this module.
"""

import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from mint_core.distributed import Rank, World, check_shares
from mint_core.errors import ConfigurationError
from mint_core.model.base import (
    BaseModel,
    BaseSource,
    default_expert_targets,
    default_targets,
    load_base,
    servable_modules,
)
from mint_core.model.datasets import IGNORE, Dataset, Row, Tokenized, collate, tokenize
from mint_core.model.experts import EXPERT_PARAMETERS, expert_lora_targets
from mint_core.model.generate import greedy_generate, seeded
from mint_core.model.sharding import gather_adapter, shard_base, staged_source
from mint_core.planning.evaluation import EVAL_GENERATION_ROWS

StepCallback = Callable[[int, int, float], None]
"""Called after each optimizer step with (step, total steps, training loss)."""
StartCallback = Callable[["TrainingConfig"], None]
"""Called once before the first step with the configuration as trained: the family's default
targets resolved on the loaded base."""


@dataclass(frozen=True)
class TrainingConfig:
    """How one adapter is trained: the hyperparameters a release takes and logs."""

    rank: int = 8
    """LoRA rank r."""
    alpha: int = 16
    """LoRA alpha; the update is scaled by alpha / rank."""
    target_modules: tuple[str, ...] = ()
    """Module names (last part, e.g. `q_proj`) that get a LoRA pair; empty: the family's
    default (`mint_core.model.base.FAMILY_TARGETS`)."""
    expert_targets: tuple[str, ...] | None = None
    """Fused MoE expert parameters that get a LoRA pair (PEFT's `target_parameters`, e.g.
    `mlp.experts.down_proj`); None: the family's default
    (`mint_core.model.base.FAMILY_EXPERT_TARGETS`), (): none."""
    dropout: float = 0.0
    """LoRA dropout on the adapted inputs while training; PEFT allows none on expert targets."""
    learning_rate: float = 2e-4
    """Peak AdamW learning rate (one-cycle schedule)."""
    epochs: float = 1.0
    """Passes over the training rows, when `steps` is not given."""
    steps: int | None = None
    """Optimizer steps; overrides `epochs`."""
    batch_size: int = 8
    """Rows per forward pass."""
    gradient_accumulation: int = 1
    """Forward passes per optimizer step."""
    max_length: int | None = None
    """Longest row in tokens; a longer one is refused. None: the base's context."""
    seed: int = 0
    """Seeds LoRA initialisation, dropout and the order of rows."""
    max_grad_norm: float = 1.0
    """Gradients are clipped to this global norm before each step (as Hugging Face's Trainer
    does by default): one bad batch cannot throw the adapter off."""

    def __post_init__(self) -> None:
        for name in ("rank", "alpha", "batch_size", "gradient_accumulation"):
            if getattr(self, name) <= 0:
                raise ConfigurationError(f"training {name}={getattr(self, name)} must be > 0")
        for name, value in (("steps", self.steps), ("max_length", self.max_length)):
            if value is not None and value <= 0:
                raise ConfigurationError(f"training {name}={value} must be > 0")
        # Written so that NaN, which fails every comparison, is refused too.
        if not (
            self.epochs > 0
            and self.learning_rate > 0
            and self.max_grad_norm > 0
            and 0 <= self.dropout < 1
        ):
            raise ConfigurationError(
                f"training epochs={self.epochs}, learning_rate={self.learning_rate} and "
                f"max_grad_norm={self.max_grad_norm} must be > 0, dropout={self.dropout} in "
                "[0, 1)"
            )

    def params(self) -> dict[str, str]:
        """Every hyperparameter as an MLflow param: a list of names comma-separated, as
        `--target-modules` takes them; a default not yet resolved on a base says so."""
        values = asdict(self)
        params = {name: str(value) for name, value in values.items()}
        for name in ("target_modules", "expert_targets"):
            value = values[name]
            if value is None or (name == "target_modules" and not value):
                params[name] = "(the base family's default)"
            else:
                params[name] = ",".join(value) or "none"
        return params

    def total_steps(self, rows: int) -> int:
        if self.steps is not None:
            return self.steps
        per_epoch = math.ceil(rows / (self.batch_size * self.gradient_accumulation))
        return max(1, math.ceil(per_epoch * self.epochs))


@dataclass(frozen=True)
class TrainedAdapter:
    """A PEFT adapter directory and what is known about how it was made."""

    path: Path
    config: TrainingConfig
    target_modules: tuple[str, ...]
    target_parameters: tuple[str, ...]
    """The fused expert parameters adapted (PEFT's `target_parameters`); () for none."""
    base_model_id: str
    base_digest: str
    dataset: str
    """Where the training rows came from (path or URI)."""
    dataset_digest: str
    steps: int
    losses: tuple[float, ...]
    """Training loss of each optimizer step."""
    eval_metrics: dict[str, float] = field(default_factory=dict)
    """`eval_loss` and `eval_exact_match` on the held-out rows."""
    run_id: str | None = None
    """The MLflow run that recorded the training, once the pipeline has one."""
    world: World = field(default_factory=World)
    """How many processes trained it, on which hosts (one, here, unless launched)."""

    def policy_fields(self) -> dict[str, object]:
        """What the policy record says about where this revision came from."""
        return {
            "base_model_id": self.base_model_id,
            "base_digest": self.base_digest,
            "dataset": self.dataset,
            "training_steps": self.steps,
            "dataset_digest": self.dataset_digest,
            "lora_rank": self.config.rank,
            "lora_alpha": self.config.alpha,
            "target_modules": self.target_modules,
            "target_parameters": self.target_parameters,
            "eval_metrics": self.eval_metrics,
            "trained_with": self.world.policy_fields(),
        }

    def made(self) -> str:
        """How it came to be: its `trained` stage entry."""
        return f"{self.steps} steps on {self.dataset}"


def train_lora(
    source: BaseSource,
    home: Path,
    data: Dataset,
    held_out: Dataset,
    out_dir: Path,
    config: TrainingConfig,
    on_step: StepCallback | None = None,
    on_start: StartCallback | None = None,
) -> TrainedAdapter:
    """Train one LoRA adapter on `data`, score it on `held_out`, save it in PEFT layout.
    Every row of both is tokenized (and so checked) before the first step. The adapter's
    `config` is the one trained: its targets resolved on the base."""
    setup = _prepare(source, home, data, held_out, config, on_start)
    losses = _optimize(setup, on_step)
    return _finish(setup, losses, out_dir, World(), _score(setup))


@dataclass(frozen=True)
class TrainJob:
    """A release's training step for `train_rank`, as the driver hands it to the ranks."""

    source: BaseSource
    home: Path
    data: Dataset
    held_out: Dataset
    out_dir: Path
    config: TrainingConfig
    shard_base: bool = False
    """Shard the frozen base over the ranks with FSDP2 (`mint_core.model.sharding`)."""


def train_rank(job: TrainJob, rank: Rank) -> TrainedAdapter | None:
    """One rank of a distributed training step (`mint_core.distributed`'s entry): the same
    steps as `train_lora` on this rank's share of every batch; rank 0 then scores and saves
    the adapter (the others are done) and sends its progress to the driver as events. With
    `job.shard_base` every rank also takes part in scoring it: each forward needs them all."""
    source = replace(job.source, device=rank.device) if rank.device else job.source
    if job.shard_base:
        source = staged_source(source, job.home, rank)
    check_shares(job.config.batch_size, rank.size)

    def started(resolved: TrainingConfig) -> None:
        rank.emit(started=asdict(resolved))

    def stepped(step: int, total: int, loss: float) -> None:
        rank.emit(step=step, total=total, loss=loss)

    setup = _prepare(source, job.home, job.data, job.held_out, job.config, started)
    if job.shard_base:
        shard_base(setup.model, rank)
    losses = _optimize(setup, stepped, rank, reduce=not job.shard_base)
    world = rank.world(sharded_base=job.shard_base)
    if not (rank.leader or job.shard_base):
        return None
    # A sharded model's every forward needs every rank: all score it and gather it.
    metrics = _score(setup, synced=job.shard_base)
    adapter = gather_adapter(setup.model) if job.shard_base else None
    if not rank.leader:
        return None
    trained = _finish(setup, losses, job.out_dir, world, metrics, adapter)
    rank.emit(allreduce_s=rank.allreduce_s)
    return trained


@dataclass(frozen=True)
class _Setup:
    """The base with a fresh LoRA on it, the rows tokenized, the configuration resolved."""

    base: BaseModel
    model: PeftModel
    rows: list[Tokenized]
    held_out: Dataset
    held_rows: list[Tokenized]
    data: Dataset
    config: TrainingConfig


def _prepare(
    source: BaseSource,
    home: Path,
    data: Dataset,
    held_out: Dataset,
    config: TrainingConfig,
    on_start: StartCallback | None,
) -> _Setup:
    base = load_base(source, home, training=True)
    max_length = config.max_length or base.context_length
    if max_length > base.context_length:
        raise ConfigurationError(
            f"max_length={max_length} exceeds the base model's context of "
            f"{base.context_length} tokens; lower --max-length"
        )
    rows = tokenize(data, base.codec, max_length)
    held_rows = tokenize(held_out, base.codec, max_length)
    targets = config.target_modules or default_targets(base.model)
    servable = {name.rsplit(".", 1)[-1] for name in servable_modules(base.model)}
    if unservable := sorted(set(targets) - servable):
        raise ConfigurationError(
            f"target modules {unservable} are not linear layers MinT serves on the base "
            f"{base.model_id} (embeddings and lm_head are not adaptable); choose from "
            f"{sorted(servable)}"
        )
    experts = _expert_targets(base, config)
    lora = LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=list(targets),
        target_parameters=list(experts) or None,
        task_type="CAUSAL_LM",
    )
    try:
        with seeded(config.seed):
            model = get_peft_model(base.model, lora)
    except ValueError as e:  # PEFT: a target module the base does not have
        raise ConfigurationError(
            f"target modules {list(targets)} do not fit the base {base.model_id}: {e}"
        ) from e
    config = replace(config, target_modules=tuple(targets), expert_targets=experts)
    if on_start is not None:
        on_start(config)
    return _Setup(base, model, rows, held_out, held_rows, data, config)


def _score(setup: _Setup, synced: bool = False) -> dict[str, float]:
    """The trained adapter's held-out metrics (`synced`: on every rank of a sharded model)."""
    setup.model.eval()
    return evaluate(setup.model, setup.base, setup.held_out, setup.held_rows, synced)


def _finish(
    setup: _Setup,
    losses: list[float],
    out_dir: Path,
    world: World,
    metrics: dict[str, float],
    adapter: dict[str, torch.Tensor] | None = None,
) -> TrainedAdapter:
    """Save the adapter (`adapter`: its tensors gathered whole from a sharded model)."""
    base, config = setup.base, setup.config
    save_peft(setup.model, out_dir, base.name_or_path, adapter)
    return TrainedAdapter(
        path=out_dir,
        config=config,
        target_modules=config.target_modules,
        target_parameters=config.expert_targets or (),
        base_model_id=base.model_id,
        base_digest=base.digest,
        dataset=setup.data.source,
        dataset_digest=setup.data.digest,
        steps=len(losses),
        losses=tuple(losses),
        eval_metrics=metrics,
        world=world,
    )


def _expert_targets(base: BaseModel, config: TrainingConfig) -> tuple[str, ...]:
    """The fused expert parameters `config` adapts on `base`, each checked to select some."""
    experts = (
        default_expert_targets(base.model)
        if config.expert_targets is None
        else config.expert_targets
    )
    if not experts:
        return ()
    if unmatched := [p for p in experts if not expert_lora_targets(base.model, (p,))]:
        known = expert_lora_targets(base.model, EXPERT_PARAMETERS).values()
        raise ConfigurationError(
            f"expert targets {unmatched} select no fused expert parameter of the base "
            f"{base.model_id}; choose from {sorted({t.parameter for t in known})} (e.g. "
            "mlp.experts.down_proj), or pass none"
        )
    if config.dropout:
        # PEFT 0.21's ParamWrapper (target_parameters) refuses lora_dropout outright.
        raise ConfigurationError(
            f"dropout={config.dropout} with expert targets {list(experts)}: PEFT's LoRA on fused "
            "expert parameters (target_parameters) supports no dropout; train with dropout 0 "
            "or without expert targets"
        )
    return tuple(experts)


def _optimize(
    setup: _Setup, on_step: StepCallback | None, rank: Rank | None = None, reduce: bool = True
) -> list[float]:
    """The optimizer steps. With `rank`, every rank draws the same global batches (one seed)
    and takes its share of each; its loss is summed over its tokens and divided by the whole
    batch's, so that the gradients summed over the ranks are one process's on that batch.
    They are summed here unless not `reduce`: a sharded base's FSDP sums them itself."""
    model, base, config, rows = setup.model, setup.base, setup.config, setup.rows
    total = config.total_steps(len(rows))
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=config.learning_rate, total_steps=total
    )
    batches = _batches(rows, config.batch_size, config.seed)
    losses = []
    for step in range(1, total + 1):
        step_loss = 0.0
        for _ in range(config.gradient_accumulation):
            chosen = next(batches)
            scale = {}
            if rank is not None:
                scale = {"num_items_in_batch": sum(_label_count(r) for r in chosen)}
                chosen = rank.shard(chosen)
            batch = {k: v.to(base.device) for k, v in collate(chosen, base.codec).items()}
            loss = model(**batch, **scale).loss / config.gradient_accumulation
            loss.backward()
            step_loss += loss.item()
        if rank is not None:
            if reduce:
                rank.all_reduce_grads(trainable)
            step_loss = rank.sum(step_loss)
        torch.nn.utils.clip_grad_norm_(trainable, config.max_grad_norm)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(step_loss)
        if on_step is not None:
            on_step(step, total, step_loss)
    return losses


def _label_count(row: Tokenized) -> int:
    """The tokens a row's loss is taken over (the labels the causal shift leaves)."""
    return sum(label != IGNORE for label in row.labels[1:])


def _batches(rows: list[Tokenized], size: int, seed: int) -> Iterator[list[Tokenized]]:
    """Endless batches: every row once per epoch, in a seeded order per epoch."""
    rng = random.Random(seed)
    while True:
        order = list(range(len(rows)))
        rng.shuffle(order)
        for start in range(0, len(order), size):
            yield [rows[i] for i in order[start : start + size]]


@torch.inference_mode()
def evaluate(
    model: torch.nn.Module,
    base: BaseModel,
    held_out: Dataset,
    rows: Sequence[Tokenized],
    synced: bool = False,
) -> dict[str, float]:
    """`eval_loss` (mean token loss over every held-out row) and `eval_exact_match` (share of
    held-out rows, at most EVAL_GENERATION_ROWS, whose greedy answer is exactly theirs).
    `synced`: every rank of a sharded model runs this at once, on the same rows."""
    losses, tokens = 0.0, 0
    for start in range(0, len(rows), 16):
        chunk = rows[start : start + 16]
        batch = {k: v.to(base.device) for k, v in collate(chunk, base.codec).items()}
        count = sum(_label_count(r) for r in chunk)
        losses += model(**batch).loss.item() * count
        tokens += count
    return {
        "eval_loss": losses / max(tokens, 1),
        "eval_exact_match": exact_match(model, base, held_out.rows[:EVAL_GENERATION_ROWS], synced),
    }


def exact_match(
    model: torch.nn.Module, base: BaseModel, rows: Sequence[Row], synced: bool = False
) -> float:
    """Share of `rows` whose greedy answer (ending by itself) is exactly the expected one.
    `synced`: ranks of a sharded model generate in step, each forward on all of them, until
    every rank's rows have ended (`synced_gpus`)."""
    prompts, answers = [], []
    for row in rows:
        asked, answer = row.prompt_and_answer()
        prompts.append(
            base.codec.encode(asked) if isinstance(asked, str) else base.codec.encode_chat(asked)
        )
        answers.append(answer)
    hits = 0
    for start in range(0, len(prompts), 32):
        chunk = prompts[start : start + 32]
        longest = max(len(base.codec.encode_answer(a)) for a in answers[start : start + 32])
        room = base.context_length - max(len(p) for p in chunk)
        generations = greedy_generate(
            model, base.codec, chunk, max(1, min(longest + 2, room)), synced_gpus=synced
        )
        hits += sum(
            g.finished and g.text == answer
            for g, answer in zip(generations, answers[start : start + 32], strict=True)
        )
    return hits / max(len(rows), 1)


def save_peft(
    model: PeftModel,
    out_dir: Path,
    base_name_or_path: str,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> None:
    """`model`'s LoRA in PEFT's layout in `out_dir`, naming `base_name_or_path` (a hub id or
    a folder's full path: `BaseText.name_or_path`) as its base, so that PEFT's own loaders
    (`AutoPeftModelForCausalLM`) find the base. `state_dict`: the LoRA's tensors when the
    model holds only shards of them (`sharding.gather_adapter`)."""
    model.peft_config["default"].base_model_name_or_path = base_name_or_path
    out_dir.mkdir(parents=True, exist_ok=True)
    # Embedding layers are not adapted; saying so stops PEFT from looking the base up on a hub.
    model.save_pretrained(out_dir, state_dict=state_dict, save_embedding_layers=False)
