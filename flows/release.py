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

from flows.rollout import StageClock, roll_out
from mint_core.access import EVERYONE
from mint_core.config import MintConfig
from mint_core.errors import ConfigurationError
from mint_core.model.datasets import DEFAULT_EVAL_FRACTION, Dataset
from mint_core.model.imports import ImportedAdapter
from mint_core.model.training import EVAL_GENERATION_ROWS, TrainedAdapter, TrainingConfig
from mint_core.revisions import RevisionId, RevisionRef, check_adapter_name
from tasks.pipeline import (
    check_import,
    export_adapter,
    freeze_adapter,
    load_data,
    pack_adapter,
    register_revision,
    train_adapter,
)


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


@flow(name="release")
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
) -> ReleaseReport:
    """Train a LoRA on the JSONL rows at `data` (a path or an s3:// URI) and release it as the
    next revision of `adapter`.

    Held-out rows come from `eval_data`, or else are a seeded `eval_fraction` of `data`.
    `target_modules` default to the base family's projections and `expert_targets` (fused MoE
    expert parameters; [] for none) to its experts' projections; `steps` overrides `epochs`;
    `max_length` defaults to the base's context. `principals` may use the revision; default
    everyone. `base_model` (a model folder or hub id) trains it on that base instead of
    MINT_BASE_MODEL's: the workers serving that base take it."""
    config = on_base(MintConfig.from_env(), base_model)
    check_adapter_name(adapter)
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
    rows, held_out = timed("data", load_data, config, data, eval_data, eval_fraction, seed)
    trained = timed("train", train_adapter, config, adapter, rows, held_out, training)
    revision = _ship(config, adapter, trained, actor, principals, timed, "release", held_out)
    scored = held_out.describe(min(len(held_out.rows), EVAL_GENERATION_ROWS))
    return ReleaseReport(str(revision), dict(trained.eval_metrics), timed.seconds, scored)


@flow(name="import")
def import_adapter(
    adapter: str,
    path: str,
    actor: str = "mint",
    principals: list[str] | None = None,
    base_model: str | None = None,
    same_base_as: str = "",
) -> ReleaseReport:
    """Release a PEFT LoRA adapter trained elsewhere (the folder at `path`) as the next
    revision of `adapter`, once it is checked to fit its base (`base_model`, default
    MINT_BASE_MODEL's) and to have been trained on it; `same_base_as`, the base the adapter
    records, says that base is a renamed copy of this one."""
    config = on_base(MintConfig.from_env(), base_model)
    check_adapter_name(adapter)
    timed = StageClock()
    imported = timed("check", check_import, config, Path(path), same_base_as)
    revision = _ship(config, adapter, imported, actor, principals, timed, "import")
    return ReleaseReport(str(revision), {}, timed.seconds)


def on_base(config: MintConfig, base_model: str | None) -> MintConfig:
    """`config` with `base_model` as the base adapters are trained on and checked against: in
    a fleet of several bases, a release names the one it is for."""
    if not base_model:
        return config
    return dataclasses.replace(config, base=dataclasses.replace(config.base, name=base_model))


def _ship(
    config: MintConfig,
    adapter: str,
    source: TrainedAdapter | ImportedAdapter,
    actor: str,
    principals: list[str] | None,
    timed: StageClock,
    reason: str,
    held_out: Dataset | None = None,
) -> RevisionId:
    """freeze -> pack -> export -> register -> admit -> prewarm -> activate."""
    frozen = timed("freeze", freeze_adapter, config, source.path)
    packed_dir, index = timed("pack", pack_adapter, config, frozen)
    exported = timed("export", export_adapter, config, packed_dir, index)
    allowed = tuple(principals) if principals else (EVERYONE,)
    revision = timed(
        "register",
        register_revision,
        config,
        adapter,
        source,
        frozen,
        exported,
        actor,
        allowed,
        held_out,
        RevisionRef(adapter),
    )
    # From here on the revision stays registered whatever happens: promote can roll it out.
    roll_out(config, revision, actor, reason, timed=timed)
    return revision


@flow(name="retrain")
def retrain(adapter: str, data: str, steps: int | None = None) -> ReleaseReport:
    """Train `adapter` again on the rows at `data` as they are now (the file is read afresh)
    and release the result as its next revision. The seed is the run's scheduled time: each
    scheduled run shuffles and initialises anew, and a rerun of one run does the same again."""
    scheduled = prefect.runtime.flow_run.scheduled_start_time
    seed = int(scheduled.timestamp()) if scheduled else int(time.time())
    return release(adapter, data, steps=steps, seed=seed, actor="retrain")
