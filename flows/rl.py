"""The RL flow: GRPO on a LoRA, sampling from the worker that serves the adapter's `rl` alias.

It ships its start (a zero LoRA, or a copy of a registered revision of the adapter, e.g. one
trained by `release`) as the run's first revision and points `<adapter>@rl` at it; then each
step samples completions of fresh prompts from `<adapter>@rl` (temperature 1, log-probabilities
and, on an MoE base, routes), takes one GRPO step with the routes replayed and the IcePop mask,
and logs its figures to the run's MLflow run; every `sync_every` steps the LoRA is shipped
through the release pipeline (freeze, pack, export, register, admit, prewarm) and `rl` moves to
it. Every sampled batch is thus attributable to an exact revision, and every revision records
its parent, its training step and `rl:<task>`. With `nproc_per_node` > 1 the policy update
runs on that many processes of this host (torchrun, data parallel over each step's prompts);
the sampler stays the serving worker.
"""

from dataclasses import dataclass, field

from prefect import flow

from flows.ending import ends_on_mint_error
from flows.release import on_base
from flows.rollout import StageClock, roll_out
from flows.ship import ship
from mint_core.config import MintConfig
from mint_core.errors import ConfigurationError, NotFoundError
from mint_core.model.rl import (
    ICEPOP_HIGH,
    ICEPOP_LOW,
    GrpoConfig,
    Reward,
    task_prompts,
)
from mint_core.model.toy import Task
from mint_core.registry import RegisteredRevision, Registry
from mint_core.revisions import RevisionId, RevisionRef, check_adapter_name
from mint_core.shipping import Shipment
from tasks.pipeline import Fleet
from tasks.rl import (
    PolicyTrainer,
    RlRun,
    WorkerSampler,
    batches,
    rl_step,
    save_policy,
    start_rl_run,
    start_trainer,
    stopping,
)
from tasks.runs import label_run, run_log, summarize

RL_ALIAS = "rl"


@dataclass(frozen=True)
class RlReport:
    """What an RL run did: its MLflow run, the revisions it shipped, its last step's figures."""

    run_id: str
    revisions: tuple[str, ...]
    metrics: dict[str, float] = field(default_factory=dict)
    stage_seconds: dict[str, float] = field(default_factory=dict)


@flow(name="rl", flow_run_name="rl {adapter} on {task}")
@ends_on_mint_error
def rl(
    adapter: str,
    task: str = Task.REVERSE.value,
    steps: int = 20,
    prompts: int = 8,
    group: int = 8,
    sync_every: int = 5,
    max_chars: int = 4,
    learning_rate: float = GrpoConfig.learning_rate,
    rank: int = GrpoConfig.rank,
    alpha: int = GrpoConfig.alpha,
    reward: str = GrpoConfig.reward.value,
    kl_coef: float = GrpoConfig.kl_coef,
    icepop_low: float = ICEPOP_LOW,
    icepop_high: float = ICEPOP_HIGH,
    seed: int = 0,
    start: str = "",
    actor: str = "mint",
    base_model: str | None = None,
    nproc_per_node: int = 1,
) -> RlReport:
    """GRPO on `task` (a toy task over words of at most `max_chars` letters) for `steps` steps
    of `prompts` prompts x `group` completions, shipping the LoRA as the next revision of
    `adapter` and moving `adapter@rl` to it every `sync_every` steps. It starts from a zero LoRA
    (rank and alpha as given) or, with `start` (`adapter:rN` or `adapter@alias`), from that
    revision's adapter, whose rank, alpha and targets then apply; the KL is to the start.
    IcePop drops the gradient of tokens whose ratio π_train/π_sample leaves [icepop_low,
    icepop_high]. `base_model` as in `release`. With `nproc_per_node` > 1 each step's prompts
    are shared among that many training processes on this host, which together take the step
    one process would.

    Args:
        adapter: The adapter whose revisions the run ships, e.g. `upper-rl`.
        task: The toy task: `echo`, `upper` or `reverse`.
        steps: GRPO steps.
        prompts: Prompts per step.
        group: Completions sampled per prompt (at least 2: GRPO compares them).
        sync_every: Ship the LoRA and move `adapter@rl` to it every this many steps.
        max_chars: Longest word of the task's prompts, in letters.
        learning_rate: AdamW learning rate.
        rank: LoRA rank of a zero start (a `start` revision keeps its own).
        alpha: LoRA alpha of a zero start.
        reward: How a completion is scored: `exact` (all or nothing) or `chars` (share of
            right characters).
        kl_coef: Weight of the KL to the start in the loss.
        icepop_low: IcePop's lower bound on the ratio of training to sampling probability.
        icepop_high: IcePop's upper bound on that ratio.
        seed: Seeds the prompts, the sampling and a zero start.
        start: Revision to start from, `adapter:rN` or `adapter@alias`; empty: a zero LoRA.
        actor: Your name: recorded as who shipped each revision.
        base_model: Model folder or hub id to train on instead of MINT_BASE_MODEL.
        nproc_per_node: Training processes for the policy update, on this host only (the
            sampler loop is interactive: one node); at most `prompts`. 1: the flow's own.
    """
    config = on_base(MintConfig.from_env(), base_model)
    label_run(check_adapter_name(adapter))
    toy_task = Task.parse(task)
    grpo = GrpoConfig(
        rank=rank,
        alpha=alpha,
        learning_rate=learning_rate,
        reward=Reward.parse(reward),
        kl_coef=kl_coef,
        icepop_low=icepop_low,
        icepop_high=icepop_high,
        seed=seed,
    )
    if min(steps, prompts, sync_every, nproc_per_node) < 1 or group < 2:
        raise ConfigurationError(
            f"steps={steps}, prompts={prompts}, sync_every={sync_every} and nproc_per_node="
            f"{nproc_per_node} must be at least 1, group={group} at least 2 (GRPO compares the "
            "completions of one prompt)"
        )
    if nproc_per_node > prompts:
        raise ConfigurationError(
            f"nproc_per_node={nproc_per_node} exceeds prompts={prompts}: each training process "
            "takes a share of every step's prompts; use more prompts or fewer processes"
        )
    examples = batches(task_prompts(toy_task, seed, max_chars), prompts)
    registry = Registry(config.tracking_uri)
    origin = _start_revision(registry, adapter, start)
    timed = StageClock()
    trainer = timed("start", start_trainer, config, grpo, origin, nproc_per_node)
    with stopping(trainer):
        prompt_stream = f"words<={max_chars}"
        world = trainer.world
        run = start_rl_run(config, adapter, grpo, toy_task.value, prompt_stream, seed, world)
        start_id = origin.id if origin else None
        revision, fleet = _ship_to_rl(
            config, adapter, trainer, run, {}, actor, timed, start_id, None
        )
        shipped = [revision]
        worker = fleet.workers[0]
        codec = trainer.base.codec
        sampler = WorkerSampler(worker, f"{adapter}@{RL_ALIAS}", codec, trainer.moe, seed)
        figures: dict[str, float] = {}
        # Each step's figures are handed to a sender, which MLflow being away never makes the
        # loop wait for; shipping waits for the registry, as registration must.
        sender = registry.runs.sender(run.run_id)
        try:
            for _ in range(steps):
                metrics, revisions = timed("step", rl_step, trainer, sampler, next(examples), group)
                figures = metrics.metrics()
                sampled_by = [RevisionRef.parse(r).revision or 0 for r in revisions]
                figures["sampler_revision"] = float(max(sampled_by))
                sender.log_metrics(metrics.step, figures)
                shown = ", ".join(f"{name} {value:.4g}" for name, value in figures.items())
                run_log().info("rl step %d/%d: %s", metrics.step, steps, shown)
                if metrics.step % sync_every == 0:
                    revision, _ = _ship_to_rl(
                        config, adapter, trainer, run, figures, actor, timed, shipped[-1], fleet
                    )
                    shipped.append(revision)
            sender.close()
        except BaseException:
            try:
                sender.close()
            except Exception as e:  # the step's own failure is the one to raise
                run_log().warning(
                    "rl %s: the last steps' metrics were not all logged: %s", adapter, e
                )
            registry.runs.finish_training(run.run_id, {}, trainer.steps, failed=True)
            raise
        registry.runs.finish_training(run.run_id, {}, trainer.steps)
        summarize(
            adapter,
            f"rl {adapter} on {toy_task.value}: {trainer.steps} steps",
            {"revisions": ", ".join(map(str, shipped)), "MLflow run": run.run_id} | figures,
        )
    return RlReport(run.run_id, tuple(map(str, shipped)), figures, timed.seconds)


def _ship_to_rl(
    config: MintConfig,
    adapter: str,
    trainer: PolicyTrainer,
    run: RlRun,
    figures: dict[str, float],
    actor: str,
    timed: StageClock,
    parent: RevisionId | None,
    fleet: Fleet | None,
) -> tuple[RevisionId, Fleet]:
    """save -> ship (freeze, pack, export, register with `parent`, the revision it trained
    from) -> roll out to `rl`, ungated (admit -> prewarm -> activate, in the adapter's roll-out
    slot like any roll-out), on `fleet`: the workers of the run's base, resolved at its first
    revision. The revision and the fleet."""
    trained = timed("save", save_policy, config, adapter, trainer, run, figures)
    parent_ref = RevisionRef(adapter, revision=parent.number) if parent else None
    revision = ship(config, Shipment(adapter, trained, actor, parent=parent_ref), timed)
    reason = f"rl step {trainer.steps}"
    fleet = roll_out(
        config, revision, actor, reason, timed=timed, alias=RL_ALIAS, gated=False, fleet=fleet
    )
    return revision, fleet


def _start_revision(registry: Registry, adapter: str, start: str) -> RegisteredRevision | None:
    """The registered revision `start` names (None for ""); it must be one of `adapter`'s, so
    that the run's revisions continue its line."""
    if not start:
        return None
    ref = RevisionRef.parse(start)
    if ref.adapter != adapter:
        raise ConfigurationError(
            f"start={start!r} is a revision of {ref.adapter}, not of {adapter}; RL continues an "
            f"adapter's own line: start from {adapter}:rN or {adapter}@alias"
        )
    try:
        return registry.revisions.resolve(ref)
    except NotFoundError as e:
        raise NotFoundError(
            f"start={start!r}: {e}; start from a registered revision of {adapter} (or none)"
        ) from e
