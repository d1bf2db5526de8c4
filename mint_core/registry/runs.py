"""MLflow runs: what training a revision records (hyperparameters, dataset, loss curve,
evaluation metrics), and the run a revision's policy record is kept in."""

import json
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, Run, RunTag
from mlflow.exceptions import MlflowException
from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

from mint_core.registry._mlflow import (
    EXPERIMENT_KIND_TAG,
    HOST_RUN_TAG,
    MODEL_DEVELOPMENT,
    REVISION_RUN_TAG,
    RUN_NAME_TAG,
    MlflowStore,
    missing,
)
from mint_core.registry.run_metrics import RunMetrics
from mint_core.revisions import POLICY_FILE, TAG_PREFIX, PolicyRecord

EXPERIMENT = "mint-releases"
"""The MLflow experiment every training and import run goes to."""

_EXPERIMENT_IDS: dict[str, str] = {}
"""`EXPERIMENT`'s id per tracking URI, looked up once per process: it does not change while the
experiment exists, and every registration of an imported adapter would ask for it again. A run
that cannot be created in the remembered one looks it up again (`_create_run`)."""


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


@dataclass(frozen=True)
class Runs:
    """Training runs and the runs policy records are kept in."""

    store: MlflowStore

    def _experiment_id(self) -> str:
        known = _EXPERIMENT_IDS.get(self.store.tracking_uri)
        if known is not None:
            return known
        experiment = self.store.client.get_experiment_by_name(EXPERIMENT)
        if experiment is None:
            experiment_id = self.store.client.create_experiment(
                EXPERIMENT, tags={EXPERIMENT_KIND_TAG: MODEL_DEVELOPMENT}
            )
        else:
            experiment_id = experiment.experiment_id
            if experiment.tags.get(EXPERIMENT_KIND_TAG) != MODEL_DEVELOPMENT:
                # An experiment made before MinT set its kind (MLflow would open it as GenAI).
                self.store.client.set_experiment_tag(
                    experiment_id, EXPERIMENT_KIND_TAG, MODEL_DEVELOPMENT
                )
        _EXPERIMENT_IDS[self.store.tracking_uri] = experiment_id
        return experiment_id

    def _create_run(self, run_name: str, tags: Mapping[str, str]) -> Run:
        """A new run in `EXPERIMENT`. The remembered experiment may have been deleted (or the
        server's database replaced) since it was looked up: then it is looked up again, once."""
        remembered = self.store.tracking_uri in _EXPERIMENT_IDS
        try:
            return self.store.client.create_run(self._experiment_id(), run_name=run_name, tags=tags)
        except MlflowException as e:
            # A deleted experiment is refused as an invalid parameter, an unknown one as missing.
            if not remembered or not (missing(e) or e.error_code == "INVALID_PARAMETER_VALUE"):
                raise
            _EXPERIMENT_IDS.pop(self.store.tracking_uri, None)
            return self.store.client.create_run(self._experiment_id(), run_name=run_name, tags=tags)

    def start_training(
        self, adapter: str, params: Mapping[str, str], dataset: DatasetLog, host: str = ""
    ) -> str:
        """An MLflow run for training a revision of `adapter` (on `host`, when named): its
        hyperparameters as params, its dataset as the run's input (with the file as an artifact
        when it is local). The params resolved once the base is loaded and the loss curve
        follow (`sender`), then `finish_training`."""
        with self.store.failing(f"start a training run for {adapter!r}"):
            tags = {TAG_PREFIX + "adapter": adapter} | ({HOST_RUN_TAG: host} if host else {})
            run_id = self._create_run(f"{adapter}-train", tags).info.run_id
            self.store.client.log_batch(run_id, params=_params(params))
            self.store.client.log_inputs(run_id, [dataset.input()])
            if dataset.local_path is not None:
                self.store.client.log_artifact(run_id, str(dataset.local_path), "dataset")
        return run_id

    def sender(self, run_id: str) -> RunMetrics:
        """What training logs to run `run_id` while it trains (its params, each step's
        metrics), sent in the background: handing a batch over never waits on MLflow, and
        `close()` waits until all were sent (`run_metrics`)."""
        return RunMetrics(self.store.client, run_id)

    def log_params(self, run_id: str, params: Mapping[str, str]) -> None:
        """Every param in `params`, in one request (a param, once logged, never changes)."""
        self.store.client.log_batch(run_id, params=_params(params))

    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None:
        """Every tag in `tags`, in one request."""
        self.store.client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])

    def log_metrics(self, run_id: str, step: int, metrics: Mapping[str, float]) -> None:
        """Every metric in `metrics` at `step`, in one request; none for no metrics (MLflow's
        client would send nothing and return, which would count as the server answering and
        end an outage the next call meets again)."""
        if not metrics:
            return
        now = _now_ms()
        batch = [Metric(name, value, now, step) for name, value in sorted(metrics.items())]
        self.store.client.log_batch(run_id, metrics=batch)

    def finish_training(
        self, run_id: str, metrics: Mapping[str, float], step: int, failed: bool = False
    ) -> None:
        """Record the evaluation metrics and end the run (FAILED when training failed): two
        requests, whatever the number of metrics (one when there are none)."""
        self.log_metrics(run_id, step, metrics)
        self.store.end_run(run_id, "FAILED" if failed else "FINISHED")

    def start_release(self, policy: PolicyRecord, run_id: str | None) -> str:
        """The run the policy record is kept in, the record written as its JSON artifact: the
        training run `run_id`, or a new run for an imported adapter (which has no training
        run), which `finish_release` ends."""
        if run_id is not None:
            self.store.client.log_text(run_id, policy.to_json(), POLICY_FILE)
            return run_id
        name = f"{policy.adapter}-{policy.content_digest[7:19]}"
        run = self._create_run(name, {TAG_PREFIX + "adapter": policy.adapter})
        # The new run says where its artifacts go: writing there saves the read of the run
        # that `log_text` makes to find out.
        repository = get_artifact_repository(
            run.info.artifact_uri, tracking_uri=self.store.tracking_uri
        )
        with tempfile.TemporaryDirectory(prefix="mint-policy-") as folder:
            path = Path(folder) / POLICY_FILE
            path.write_text(policy.to_json(), encoding="utf-8")
            repository.log_artifact(str(path))
        return run.info.run_id

    def finish_release(
        self, run_id: str, policy: PolicyRecord, revision: str, imported: bool
    ) -> None:
        """Name the run after the revision it made, which exists only once its model version
        does, so that the experiment's runs list reads `upper-bot:r2`, not one name for every
        revision; an imported adapter's run also gets the policy's evaluation metrics and ends.
        One request, two for an import."""
        metrics = []
        if imported:
            now = _now_ms()
            metrics = [
                Metric(name, value, now, policy.training_steps)
                for name, value in sorted(policy.eval_metrics.items())
            ]
        tags = [RunTag(RUN_NAME_TAG, revision), RunTag(REVISION_RUN_TAG, revision)]
        self.store.client.log_batch(run_id, metrics=metrics, tags=tags)
        if imported:
            self.store.end_run(run_id, "FINISHED")
