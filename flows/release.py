"""The release flow: train -> freeze -> pack -> export -> register -> admit -> prewarm -> activate.

Registering makes a revision addressable (`name:rN`) but no user reaches it through
`name@production` until every worker reports it ready and `activate` moves the alias.
"""

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ParamSpec, TypeVar

import prefect.runtime
from prefect import flow

from mint_core.access import EVERYONE
from mint_core.base_model import BaseModelSpec
from mint_core.config import MintConfig
from mint_core.datasets import Task
from mint_core.errors import MintError, RolloutBusyError
from mint_core.imports import ImportedAdapter
from mint_core.registry import Registry
from mint_core.revisions import RevisionId, check_adapter_name
from mint_core.training import TrainedAdapter, TrainingConfig
from tasks.pipeline import (
    activate_revision,
    admit_revision,
    check_import,
    export_adapter,
    freeze_adapter,
    pack_adapter,
    prewarm_revision,
    register_revision,
    rollout_lock,
    train_adapter,
)

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class ReleaseReport:
    """What a release produced and how long each stage took."""

    revision: str
    eval_accuracy: float | None
    """Held-out accuracy of a trained revision; None for an imported one."""
    stage_seconds: dict[str, float] = field(default_factory=dict)


class _StageClock:
    """Runs pipeline steps and records how long each took."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def __call__(self, stage: str, step: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        start = time.perf_counter()
        result = step(*args, **kwargs)
        self.seconds[stage] = time.perf_counter() - start
        return result


@flow(name="release")
def release(
    adapter: str,
    task: str,
    steps: int = TrainingConfig.steps,
    rank: int = TrainingConfig.rank,
    seed: int = 0,
    base: BaseModelSpec | None = None,
    actor: str = "mint",
    principals: list[str] | None = None,
) -> ReleaseReport:
    """Train a LoRA for `task` and release it as the next revision of `adapter`.

    `base` is the base model to train on; it defaults to the serving base (the register step
    refuses anything else). `principals` may use the revision; default everyone."""
    config = MintConfig.from_env()
    check_adapter_name(adapter)
    Task.parse(task)
    training = TrainingConfig(steps=steps, rank=rank, seed=seed)
    timed = _StageClock()
    trained = timed("train", train_adapter, config, adapter, task, training, base or config.base)
    revision = _ship(config, adapter, trained, actor, principals, timed, "release")
    return ReleaseReport(str(revision), trained.eval_accuracy, timed.seconds)


@flow(name="import")
def import_adapter(
    adapter: str, path: str, actor: str = "mint", principals: list[str] | None = None
) -> ReleaseReport:
    """Release a PEFT LoRA adapter trained elsewhere (the folder at `path`) as the next
    revision of `adapter`, once it is checked to fit the serving base."""
    config = MintConfig.from_env()
    check_adapter_name(adapter)
    timed = _StageClock()
    imported = timed("check", check_import, config, Path(path))
    revision = _ship(config, adapter, imported, actor, principals, timed, "import")
    return ReleaseReport(str(revision), None, timed.seconds)


def _ship(
    config: MintConfig,
    adapter: str,
    source: TrainedAdapter | ImportedAdapter,
    actor: str,
    principals: list[str] | None,
    timed: _StageClock,
    reason: str,
) -> RevisionId:
    """freeze -> pack -> export -> register -> admit -> prewarm -> activate."""
    frozen = timed("freeze", freeze_adapter, config, source.path)
    packed_dir, index = timed("pack", pack_adapter, config, frozen)
    exported = timed("export", export_adapter, config, packed_dir, index)
    allowed = tuple(principals) if principals else (EVERYONE,)
    revision = timed(
        "register", register_revision, config, adapter, source, frozen, exported, actor, allowed
    )
    try:
        with rollout_lock(adapter):
            timed("admit", admit_revision, config, revision)
            timed("prewarm", prewarm_revision, config, revision)
            timed("activate", activate_revision, config, revision, actor=actor, reason=reason)
    except RolloutBusyError:
        raise  # it only waited: the revision stays registered, and promote can roll it out
    except Exception as e:
        # Record the failure on the revision, but never let recording it hide the cause.
        with contextlib.suppress(MintError):
            Registry(config.tracking_uri).mark_failed(revision, f"{type(e).__name__}: {e}")
        raise
    return revision


@flow(name="retrain")
def retrain(
    adapter: str,
    task: str,
    steps: int = TrainingConfig.steps,
    rank: int = TrainingConfig.rank,
) -> ReleaseReport:
    """Train `adapter` again on freshly generated `task` examples and release the result as its
    next revision. The data seed is the run's scheduled time: each scheduled run sees new
    examples, and a rerun of one run sees the same ones."""
    scheduled = prefect.runtime.flow_run.scheduled_start_time
    seed = int(scheduled.timestamp()) if scheduled else int(time.time())
    return release(adapter, task, steps=steps, rank=rank, seed=seed, actor="retrain")
