"""The steps that make an adapter: read the data, train (recorded in an MLflow run), or check
one trained elsewhere."""

import logging
import time
import uuid
from dataclasses import replace
from functools import partial
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from tqdm.auto import tqdm

from mint_core.artifacts.stores import read_data
from mint_core.config import MintConfig
from mint_core.distributed import ONE_PROCESS, Launch, World
from mint_core.model.base import load_base
from mint_core.model.datasets import Dataset, load_datasets
from mint_core.model.imports import ImportedAdapter, inspect_import
from mint_core.model.training import TrainedAdapter, TrainingConfig, TrainJob, train_lora
from mint_core.registry import DatasetLog, Registry
from mint_core.registry.run_metrics import Point, RunMetrics
from tasks.launch import train_on_ranks
from tasks.policies import ONCE_PER_RUN, transient
from tasks.runs import run_log


@task(
    name="load-data",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=1,
    retry_condition_fn=transient,
)
def load_data(
    config: MintConfig, data: str, eval_data: str | None, eval_fraction: float, adapter: str
) -> tuple[Dataset, Dataset]:
    """(training rows, held-out rows), each file read and checked whole: `eval_data` when
    given, else about `eval_fraction` of `data`'s rows, the same ones in every release of
    `adapter` (`Dataset.split`)."""
    return load_datasets(partial(read_data, config), data, eval_data, eval_fraction, adapter)


@task(name="train", cache_policy=ONCE_PER_RUN, persist_result=True)
def train_adapter(
    config: MintConfig,
    adapter: str,
    data: Dataset,
    held_out: Dataset,
    training: TrainingConfig,
    launch: Launch = ONE_PROCESS,
) -> TrainedAdapter:
    """Train inside an MLflow run that records the hyperparameters, how it was launched, the
    dataset, the loss of every step and the evaluation metrics: in this process, or on the
    ranks `launch` asks for (`tasks.launch`), rank 0's progress reported here."""
    registry = Registry(config.tracking_uri)
    local = None if data.source.startswith("s3://") else Path(data.source)
    run_facts = {
        "base_model": config.base.name or "(embedded default)",
        "train_rows": str(len(data.rows)),
        "eval_rows": str(len(held_out.rows)),
        "eval_data": held_out.describe(path=True) if held_out.held_out else held_out.source,
    }
    run_id = registry.runs.start_training(
        adapter,
        run_facts,
        DatasetLog(data.source, data.digest, len(data.rows), local),
        config.host_name,
    )
    # The hyperparameters are logged once the base is loaded, with the targets as trained (its
    # family's default resolved); as asked, if training fails before. Like the losses they go
    # through `sender`, which training hands them to without waiting on MLflow.
    logged: list[TrainingConfig] = []
    sender = registry.runs.sender(run_id)

    def started(resolved: TrainingConfig) -> None:
        sender.log_params(resolved.params() | launch.params())
        logged.append(resolved)

    out_dir = config.work_root / "train" / f"{adapter}-{uuid.uuid4().hex[:12]}"
    progress = _TrainingProgress(sender, run_log())
    try:
        job = TrainJob(
            config.base, config.home, data, held_out, out_dir, training, launch.shard_base
        )
        if launch.in_process:
            trained = train_lora(
                job.source, job.home, job.data, job.held_out, job.out_dir, job.config,
                progress.step, started,
            )  # fmt: skip
            trained = replace(trained, world=World(hosts=(config.host_name,)))
        else:
            trained = train_on_ranks(config, launch, job, progress.step, started)
        # Every loss sent before the run ends and the revision is registered: an MLflow that
        # never answered fails the release here, with the registry's error.
        progress.close()
    except BaseException:
        progress.close(failed=True)
        if not logged:
            registry.runs.log_params(run_id, training.params() | launch.params())
        registry.runs.finish_training(run_id, {}, 0, failed=True)
        raise
    registry.runs.set_tags(run_id, trained.world.tags())
    registry.runs.finish_training(run_id, trained.eval_metrics, trained.steps)
    return replace(trained, run_id=run_id)


class _TrainingProgress:
    """Each step's loss to the MLflow run (handed to its sender a few steps at a time, stamped
    when the step was taken), to a progress bar on a terminal, and (step, loss, ETA) to the
    run's log about ten times per training."""

    LOG_EVERY = 20
    LOG_LINES = 10

    def __init__(
        self, sender: RunMetrics, log: logging.Logger | logging.LoggerAdapter[logging.Logger]
    ) -> None:
        self._sender = sender
        self._log = log
        self._pending: list[Point] = []
        self._bar: tqdm | None = None
        self._started = time.monotonic()

    def close(self, failed: bool = False) -> None:
        """Hand over the last losses and wait until all were sent. `failed`: training failed
        already; what stopped the sender, if anything, is logged, not raised over that."""
        if self._bar is not None:
            self._bar.close()
        try:
            self.flush()
            self._sender.close()
        except Exception as e:
            if not failed:
                raise
            self._log.warning("the training's last losses were not all logged: %s", e)

    def step(self, step: int, total: int, loss: float) -> None:
        if self._bar is None:
            # disable=None: a bar on a terminal, nothing in logs.
            self._bar = tqdm(total=total, desc="train", unit="step", disable=None)
        self._bar.update(1)
        self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        self._pending.append(Point(step, loss))
        if len(self._pending) >= self.LOG_EVERY or step == total:
            self.flush()
        if step % max(1, total // self.LOG_LINES) == 0 or step == total:
            elapsed = time.monotonic() - self._started
            eta = elapsed / step * (total - step)
            self._log.info(
                "training step %d/%d: loss %.4f, %.0f s elapsed, ETA %.0f s",
                step,
                total,
                loss,
                elapsed,
                eta,
            )

    def flush(self) -> None:
        """Hand the losses not handed over yet to the sender (which does not wait)."""
        if self._pending:
            pending, self._pending = self._pending, []
            self._sender.log_series("train_loss", pending)


@task(name="check-import", cache_policy=NO_CACHE)
def check_import(config: MintConfig, adapter_dir: Path, same_base_as: str = "") -> ImportedAdapter:
    return inspect_import(adapter_dir, load_base(config.base, config.home), same_base_as)
