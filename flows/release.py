"""The release flow: train -> freeze -> pack -> export -> register -> admit -> prewarm -> activate.

Registering makes a revision addressable (`name:rN`) but no user reaches it through
`name@production` until every worker reports it ready and `activate` moves the alias.
"""

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

import prefect.runtime
from prefect import flow

from flows.ending import ends_on_mint_error
from flows.rollout import StageClock, roll_out
from flows.ship import ship
from mint_core.access import EVERYONE
from mint_core.config import MintConfig
from mint_core.distributed import DEFAULT_TIMEOUT_S, Launch, World
from mint_core.errors import ConfigurationError
from mint_core.model.datasets import DEFAULT_EVAL_FRACTION
from mint_core.model.training import TrainingConfig
from mint_core.planning.evaluation import EVAL_GENERATION_ROWS
from mint_core.revisions import RevisionId, RevisionRef, check_adapter_name
from mint_core.shipping import Shipment
from tasks.policies import handed_whole
from tasks.runs import label_run, production_move, summarize
from tasks.training import check_import, load_data, train_adapter


@dataclass(frozen=True)
class ReleaseReport:
    """What a release produced and how long each stage took."""

    revision: str
    eval_metrics: dict[str, float] = field(default_factory=dict)
    """Held-out `eval_loss` and `eval_exact_match` of a trained revision; empty for an
    imported one."""
    stage_seconds: dict[str, float] = field(default_factory=dict)
    eval_rows: str = ""
    """Which rows `eval_exact_match` is on, e.g. "200 held-out rows of train.jsonl"."""


@flow(name="release", flow_run_name="release {adapter}")
@ends_on_mint_error
def release(
    adapter: str,
    data: str,
    eval_data: str | None = None,
    eval_fraction: float = DEFAULT_EVAL_FRACTION,
    rank: int = TrainingConfig.rank,
    alpha: int = TrainingConfig.alpha,
    target_modules: list[str] | None = None,
    expert_targets: list[str] | None = None,
    dropout: float = TrainingConfig.dropout,
    learning_rate: float = TrainingConfig.learning_rate,
    epochs: float = TrainingConfig.epochs,
    steps: int | None = None,
    batch_size: int = TrainingConfig.batch_size,
    gradient_accumulation: int = TrainingConfig.gradient_accumulation,
    max_length: int | None = None,
    seed: int = 0,
    actor: str = "mint",
    principals: list[str] | None = None,
    base_model: str | None = None,
    nproc_per_node: int = 1,
    nnodes: int = 1,
    rdzv_endpoint: str = "",
    shard_base: bool = False,
    dist_timeout_s: float = DEFAULT_TIMEOUT_S,
) -> ReleaseReport:
    """Train a LoRA on the JSONL rows at `data` (a path or an s3:// URI) and release it as the
    next revision of `adapter`.

    Args:
        adapter: The adapter to release a new revision of, e.g. `support-bot` (lower-case
            letters, digits, '-' or '_'); a new name starts at r1.
        data: Training rows: a JSONL file (an s3:// URI, or a path on the host the run runs
            on: a train host, with work pools), one `{"prompt", "completion"}` or
            `{"messages"}` object per line.
        eval_data: Held-out rows (JSONL, as `data`) the revision is scored on; empty: about
            `eval_fraction` of `data` is held out instead, chosen by each row's content for
            this adapter, so every release of it from that file holds out the same rows.
        eval_fraction: Share of `data` held out for scoring when `eval_data` is empty
            (between 0 and 1).
        rank: LoRA rank r.
        alpha: LoRA alpha; the update is scaled by alpha / rank.
        target_modules: Module names that get a LoRA pair, e.g. `q_proj`; empty: the base
            family's projections.
        expert_targets: Fused MoE expert parameters that get a LoRA pair, e.g.
            `mlp.experts.down_proj`; empty: the family's experts (an empty list: none).
        dropout: LoRA dropout while training, in [0, 1).
        learning_rate: Peak AdamW learning rate (one-cycle schedule).
        epochs: Passes over the training rows (unless `steps` is given).
        steps: Optimizer steps; overrides `epochs`. Empty: from `epochs`.
        batch_size: Rows per forward pass.
        gradient_accumulation: Forward passes per optimizer step.
        max_length: Longest row in tokens (a longer one is refused); empty: the base's
            context.
        seed: Seeds LoRA initialisation, dropout and the order of rows (not which rows are
            held out).
        actor: Your name: recorded as who released it (stage and alias histories).
        principals: API-key principals that may use the revision; empty: everyone.
        base_model: Model folder or hub id to train on instead of MINT_BASE_MODEL; the
            workers serving that base take the revision.
        nproc_per_node: Training processes on each host (torchrun's --nproc-per-node): data
            parallel over the LoRA, each taking its share of every batch; 1: in the run's own
            process.
        nnodes: Train hosts (torchrun's --nnodes): this run's host and nnodes - 1 more from
            the train pool, each running a `train-node` flow run.
        rdzv_endpoint: HOST[:PORT] the other hosts reach this one at; empty:
            MINT_TRAIN_ADDRESS and a free port.
        shard_base: Shard the frozen base over the processes (FSDP2), for a base larger than
            one device.
        dist_timeout_s: torch.distributed's timeout (rendezvous and each collective): a lost
            process fails the training after at most this long.
    """
    config = on_base(MintConfig.from_env(), base_model)
    check_adapter_name(adapter)
    label_run(adapter)
    launch = Launch(nproc_per_node, nnodes, rdzv_endpoint, dist_timeout_s, shard_base)
    training = TrainingConfig(
        rank=rank,
        alpha=alpha,
        target_modules=tuple(target_modules or ()),
        expert_targets=None if expert_targets is None else tuple(expert_targets),
        dropout=dropout,
        learning_rate=learning_rate,
        epochs=epochs,
        steps=steps,
        batch_size=batch_size,
        gradient_accumulation=gradient_accumulation,
        max_length=max_length,
        seed=seed,
    )
    if not 0 < eval_fraction < 1:
        raise ConfigurationError(f"eval_fraction={eval_fraction} must be between 0 and 1")
    timed = StageClock()
    rows, held_out = timed("data", load_data, config, data, eval_data, eval_fraction, adapter)
    train = handed_whole(train_adapter)  # the datasets, not walked row by row
    trained = timed("train", train, config, adapter, rows, held_out, training, launch)
    shipment = Shipment(
        adapter,
        trained,
        actor,
        principals=_allowed(principals),
        held_out=held_out,
        parent=RevisionRef(adapter),
        trained_on=rows,
    )
    revision = _release(config, shipment, timed, "release")
    scored = held_out.describe(min(len(held_out.rows), EVAL_GENERATION_ROWS))
    report = ReleaseReport(str(revision), dict(trained.eval_metrics), timed.seconds, scored)
    _summarize(config, adapter, report, scored, trained.world)
    return report


@flow(name="import", flow_run_name="import {adapter}")
@ends_on_mint_error
def import_adapter(
    adapter: str,
    path: str,
    actor: str = "mint",
    principals: list[str] | None = None,
    base_model: str | None = None,
    same_base_as: str = "",
) -> ReleaseReport:
    """Release a PEFT LoRA adapter trained elsewhere (the folder at `path`) as the next
    revision of `adapter`, once it is checked to fit its base.

    Args:
        adapter: The adapter to release it as the next revision of, e.g. `support-bot`.
        path: The PEFT adapter folder (adapter_config.json and weights) on the host the run
            runs on (a train host, with work pools).
        actor: Your name: recorded as who imported it (stage and alias histories).
        principals: API-key principals that may use the revision; empty: everyone.
        base_model: Model folder or hub id it was trained on, if not MINT_BASE_MODEL.
        same_base_as: The base the adapter records, when the base it is imported on is a
            renamed copy of it (a different model family is refused all the same).
    """
    config = on_base(MintConfig.from_env(), base_model)
    check_adapter_name(adapter)
    label_run(adapter)
    timed = StageClock()
    imported = timed("check", check_import, config, Path(path), same_base_as)
    shipment = Shipment(
        adapter, imported, actor, principals=_allowed(principals), parent=RevisionRef(adapter)
    )
    revision = _release(config, shipment, timed, "import")
    report = ReleaseReport(str(revision), {}, timed.seconds)
    _summarize(config, adapter, report, "")
    return report


def _summarize(
    config: MintConfig,
    adapter: str,
    report: ReleaseReport,
    held_out: str,
    world: World | None = None,
) -> None:
    """The run's summary artifact: the revision, where production went, the host it was made
    on (and how many processes on which hosts trained it), its held-out figures (and on which
    rows) and each stage's time."""
    facts: dict[str, object] = {"revision": report.revision}
    facts["production"] = production_move(config, adapter)
    facts["host"] = config.host_name
    if world is not None and world.size > 1:
        facts["trained on"] = world.describe()
    facts |= {f"{name} ({held_out})": value for name, value in report.eval_metrics.items()}
    facts["stages"] = ", ".join(f"{k} {v:.1f} s" for k, v in report.stage_seconds.items())
    summarize(adapter, f"released {report.revision}", facts)


def on_base(config: MintConfig, base_model: str | None) -> MintConfig:
    """`config` with `base_model` as the base adapters are trained on and checked against: in
    a fleet of several bases, a release names the one it is for."""
    if not base_model:
        return config
    return dataclasses.replace(config, base=dataclasses.replace(config.base, name=base_model))


def _release(config: MintConfig, shipment: Shipment, timed: StageClock, reason: str) -> RevisionId:
    """ship (freeze -> pack -> export -> register) -> roll out (admit -> prewarm -> activate)."""
    revision = ship(config, shipment, timed)
    # From here on the revision stays registered whatever happens: promote can roll it out.
    roll_out(config, revision, shipment.actor, reason, timed=timed)
    return revision


SCHEDULED = "schedule"
"""Who a retrain started by its deployment's schedule (`MINT_RETRAIN`) is recorded as."""


def _allowed(principals: list[str] | None) -> tuple[str, ...]:
    """The principals a flow parameter names; none named: everyone."""
    return tuple(principals) if principals else (EVERYONE,)


@flow(name="retrain", flow_run_name="retrain {adapter}")
@ends_on_mint_error
def retrain(
    adapter: str,
    data: str,
    steps: int | None = None,
    actor: str = SCHEDULED,
    nproc_per_node: int = 1,
    nnodes: int = 1,
) -> ReleaseReport:
    """Train `adapter` again on the rows at `data` as they are now (the file is read afresh)
    and release the result as its next revision. The seed is the run's scheduled time: each
    scheduled run shuffles and initialises anew, and a rerun of one run does the same again.
    The rows held out do not depend on it: each run holds out the ones earlier runs did (and
    the new rows' share), so the gate scores no candidate on rows it trained on.

    Args:
        adapter: The adapter to retrain, e.g. `support-bot`.
        data: Training rows: a JSONL file (an s3:// URI, or a path on the host the run runs
            on).
        steps: Optimizer steps; empty: one epoch over `data`.
        actor: Your name: recorded as who retrained it (stage and alias histories); a
            scheduled run records the schedule.
        nproc_per_node: Training processes on each host, as in `release`.
        nnodes: Train hosts, as in `release`.
    """
    label_run(check_adapter_name(adapter))
    scheduled = prefect.runtime.flow_run.scheduled_start_time
    seed = int(scheduled.timestamp()) if scheduled else int(time.time())
    return release(
        adapter,
        data,
        steps=steps,
        seed=seed,
        actor=actor,
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
    )
