"""The rl flow's policy update on several processes: each rank's side of a long-lived job.

The rl flow samples between steps (a serving worker, then shipping every few steps), so its
trainer cannot be a one-shot launch like a release's: the ranks start once, build the same
GrpoTrainer, and wait for the driver's requests (`Rank.receive`, rank 0 broadcasting each).
A step request carries every group to every rank; each feeds its share (`GrpoTrainer.step`
with its `Rank`) and rank 0 answers with the step's figures. Only rank 0 saves.
"""

from dataclasses import dataclass, replace
from pathlib import Path

from peft import LoraConfig

from mint_core.distributed import Rank, World
from mint_core.errors import ConfigurationError
from mint_core.model.base import BaseSource, load_base
from mint_core.model.rl import Group, GrpoConfig, GrpoTrainer, StepMetrics

ENTRY = "mint_core.model.rl_ranks:rl_rank"
"""What `processes.torchrun.start_ranks` is given as the job's function."""


@dataclass(frozen=True)
class RlJob:
    """What every rank builds its trainer from (the driver's base and start, on its disk:
    the ranks run on the driver's node)."""

    source: BaseSource
    home: Path
    config: GrpoConfig
    start: Path | None = None
    """The start adapter's PEFT folder; None: a zero LoRA."""


@dataclass(frozen=True)
class Describe:
    """Asks rank 0 for `Described`, once every rank has built its trainer."""


@dataclass(frozen=True)
class Described:
    """What the driver needs to know of the ranks' trainer without loading the base's weights."""

    lora: LoraConfig
    target_modules: tuple[str, ...]
    target_parameters: tuple[str, ...]
    moe: bool
    world: World


@dataclass(frozen=True)
class Step:
    """One GRPO step on `groups` (all of them: each rank takes its share); answer: StepMetrics."""

    groups: tuple[Group, ...]


@dataclass(frozen=True)
class Save:
    """The LoRA as a PEFT folder at `out_dir` (rank 0 writes it); answer: the folder."""

    out_dir: Path


@dataclass(frozen=True)
class Stop:
    """The ranks end; answer: the steps taken."""


def rl_rank(job: RlJob, rank: Rank) -> int:
    """One rank of the rl flow's policy update: build the trainer, then answer the driver's
    requests until it says Stop. The steps taken."""
    source = replace(job.source, device=rank.device) if rank.device else job.source
    base = load_base(source, job.home, training=True)
    trainer = GrpoTrainer(base, job.config, job.start)
    trainer.world = rank.world()
    while True:
        request = rank.receive()
        match request:
            case Describe():
                rank.reply(
                    Described(
                        trainer.lora,
                        trainer.target_modules,
                        trainer.target_parameters,
                        trainer.moe,
                        trainer.world,
                    )
                )
            case Step(groups):
                metrics: StepMetrics = trainer.step(groups, rank)
                rank.emit(step=metrics.step, allreduce_s=rank.allreduce_s)
                rank.reply(metrics)
            case Save(out_dir):
                rank.reply(trainer.save(out_dir) if rank.leader else None)
            case Stop():
                rank.reply(trainer.steps)
                return trainer.steps
            case _:
                raise ConfigurationError(f"the rl ranks got {request!r}, not a request they take")
