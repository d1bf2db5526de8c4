"""A release that stops dead at a chosen point, for the SIGKILL tests.

    python -m tests.integration.release_until {export,register} MARKER ADAPTER

Runs the real release flow (configuration from the environment) but, in the middle of the
chosen step, writes MARKER and sleeps until the test kills the process: during export, once a
shard is in the store (local: copied into the staging folder; S3: uploaded, the index not yet);
during register, after the MLflow run and
registered model exist and before the model version does.
"""

import functools
import shutil
import sys
import time
from pathlib import Path

from mlflow.tracking import MlflowClient

from mint_core.artifacts import stores as artifact_store
from tests.integration.helpers import toy_release as release


def stop_here(marker: Path) -> None:
    marker.write_text("paused")
    time.sleep(600)


def pause_export_after_first_shard(marker: Path) -> None:
    def copy_then_stop(src: str, dst: str, **kwargs: object) -> object:
        copied = shutil.copy2(src, dst, **kwargs)  # type: ignore[arg-type]
        if Path(src).name.startswith("shard-"):
            stop_here(marker)
        return copied

    artifact_store.shutil.copytree = functools.partial(  # type: ignore[attr-defined]
        shutil.copytree, copy_function=copy_then_stop
    )

    def stop_before_index_upload(params: dict[str, object], **_: object) -> None:
        if str(params.get("url_path", "")).endswith("/index.json"):
            stop_here(marker)

    s3_init = artifact_store.S3ArtifactStore.__init__

    def init_with_hook(self: artifact_store.S3ArtifactStore, *args: object) -> None:
        s3_init(self, *args)  # type: ignore[arg-type]
        self.s3.meta.events.register("before-call.s3.PutObject", stop_before_index_upload)

    artifact_store.S3ArtifactStore.__init__ = init_with_hook  # type: ignore[method-assign]


def pause_register_before_version(marker: Path) -> None:
    create_model_version = MlflowClient.create_model_version

    def stop_then_create(self: MlflowClient, *args: object, **kwargs: object) -> object:
        stop_here(marker)
        return create_model_version(self, *args, **kwargs)  # type: ignore[arg-type]

    MlflowClient.create_model_version = stop_then_create  # type: ignore[method-assign]


def main() -> None:
    point, marker, adapter = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    {"export": pause_export_after_first_shard, "register": pause_register_before_version}[point](
        marker
    )
    release(adapter, "upper", steps=10)


if __name__ == "__main__":
    main()
