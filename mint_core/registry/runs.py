"""MLflow runs: what training a revision records (hyperparameters, dataset, loss curve,
evaluation metrics), and the run a revision's policy record is kept in."""

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param

from mint_core.registry._mlflow import EXPERIMENT_KIND_TAG, MODEL_DEVELOPMENT, MlflowStore
from mint_core.revisions import POLICY_FILE, TAG_PREFIX, PolicyRecord

EXPERIMENT = "mint-releases"
"""The MLflow experiment every training and import run goes to."""


@dataclass(frozen=True)
class DatasetLog:
    """A training dataset as an MLflow run records it."""

    source: str
    """Its path or URI."""
    digest: str
    """sha256 of its bytes."""
    rows: int
    local_path: Path | None = None
    """The file, when it is local: logged as an artifact of the run."""

    def input(self) -> DatasetInput:
        name = self.source.rstrip("/").rsplit("/", 1)[-1]
        source_type = "s3" if self.source.startswith("s3://") else "local"
        dataset = Dataset(
            name=name,
            digest=self.digest.removeprefix("sha256:")[:36],
            source_type=source_type,
            source=json.dumps({"uri": self.source}),
            profile=json.dumps({"num_rows": self.rows, "sha256": self.digest}),
        )
        return DatasetInput(dataset, [InputTag("mlflow.data.context", "training")])


def _params(params: Mapping[str, str]) -> list[Param]:
    return [Param(name, value) for name, value in sorted(params.items())]


def _now_ms() -> int:
    return int(datetime.now(UTC).timestamp() * 1000)


class Runs(MlflowStore):
    """Training runs and the runs policy records are kept in."""

    def _experiment_id(self) -> str:
        experiment = self._client.get_experiment_by_name(EXPERIMENT)
        if experiment is None:
            return self._client.create_experiment(
                EXPERIMENT, tags={EXPERIMENT_KIND_TAG: MODEL_DEVELOPMENT}
            )
        if experiment.tags.get(EXPERIMENT_KIND_TAG) != MODEL_DEVELOPMENT:
            # An experiment made before MinT set its kind (MLflow would open it as GenAI).
            self._client.set_experiment_tag(
                experiment.experiment_id, EXPERIMENT_KIND_TAG, MODEL_DEVELOPMENT
            )
        return experiment.experiment_id

    def start_training_run(
        self, adapter: str, params: Mapping[str, str], dataset: DatasetLog
    ) -> str:
        """An MLflow run for training a revision of `adapter`: its hyperparameters as params,
        its dataset as the run's input (with the file as an artifact when it is local). The
        loss curve follows (`log_losses`), then `finish_training_run`."""
        with self._failing(f"start a training run for {adapter!r}"):
            run_id = self._client.create_run(
                self._experiment_id(),
                run_name=f"{adapter}-train",
                tags={TAG_PREFIX + "adapter": adapter},
            ).info.run_id
            self._client.log_batch(run_id, params=_params(params))
            self._client.log_inputs(run_id, [dataset.input()])
            if dataset.local_path is not None:
                self._client.log_artifact(run_id, str(dataset.local_path), "dataset")
        return run_id

    def log_params(self, run_id: str, params: Mapping[str, str]) -> None:
        """Every param in `params`, in one request (a param, once logged, never changes)."""
        self._client.log_batch(run_id, params=_params(params))

    def log_losses(self, run_id: str, name: str, losses: Sequence[tuple[int, float]]) -> None:
        """Metric `name` at each (step, value), in one request."""
        now = _now_ms()
        metrics = [Metric(name, value, now, step) for step, value in losses]
        self._client.log_batch(run_id, metrics=metrics)

    def log_metrics(self, run_id: str, step: int, metrics: Mapping[str, float]) -> None:
        """Every metric in `metrics` at `step`, in one request."""
        now = _now_ms()
        batch = [Metric(name, value, now, step) for name, value in sorted(metrics.items())]
        self._client.log_batch(run_id, metrics=batch)

    def finish_training_run(
        self, run_id: str, metrics: Mapping[str, float], step: int, failed: bool = False
    ) -> None:
        """Record the evaluation metrics and end the run (FAILED when training failed)."""
        for name, value in metrics.items():
            self._client.log_metric(run_id, name, value, step=step)
        self._client.set_terminated(run_id, "FAILED" if failed else "FINISHED")

    def _log_release_run(self, policy: PolicyRecord, run_id: str | None) -> str:
        """The policy record as a JSON artifact of the training run, or of a new run (an
        imported adapter, which has no training run)."""
        if run_id is None:
            run_id = self._client.create_run(
                self._experiment_id(),
                run_name=f"{policy.adapter}-{policy.content_digest[7:19]}",
                tags={TAG_PREFIX + "adapter": policy.adapter},
            ).info.run_id
            for name, value in policy.eval_metrics.items():
                self._client.log_metric(run_id, name, value, step=policy.training_steps)
            self._client.set_terminated(run_id)
        self._client.log_text(run_id, policy.to_json(), POLICY_FILE)
        return run_id
