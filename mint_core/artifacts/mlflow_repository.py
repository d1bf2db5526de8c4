"""MinT's local artifact store as MLflow sees it: a read-only artifact repository for
`mint-local://sha256/<hex>` model-version sources.

MLflow finds it through the `mlflow.artifact_repository` entry point (pyproject.toml), so the
MLflow server's model-version page lists a revision's files instead of failing with "Could not
find a registered artifact repository". The server resolves a URI under the store of its own
MinT configuration (`MINT_HOME`, which `services.start_mlflow` passes it), as every MinT
process does. S3 sources are `s3://` URIs, which MLflow reads itself.
"""

import os
from collections.abc import AsyncIterable, Mapping
from typing import BinaryIO

from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST
from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository

from mint_core.config import MintConfig
from mint_core.errors import ConfigurationError, NotFoundError


class MintLocalArtifactRepository(LocalArtifactRepository):
    """A revision's folder in MinT's local store, listed and downloaded as MLflow's local
    repository does; writing is refused (only MinT's export writes the store)."""

    def __init__(
        self, artifact_uri: str, tracking_uri: str | None = None, registry_uri: str | None = None
    ) -> None:
        # Here, not at the top: MLflow imports every artifact-repository plugin when it is
        # itself imported (`mint status` too), and the store loads torch through packing.
        from mint_core.artifacts.stores import LocalArtifactStore

        # The server's environment is its edge: MINT_HOME names the store it reads. Only that:
        # the rest of MinT's configuration is not the server's (its MLFLOW_TRACKING_URI is its
        # backend store, not a server URL).
        store = LocalArtifactStore(MintConfig.from_env(_home_only(os.environ)).artifact_root)
        try:
            folder = store.fetch(artifact_uri)
        except (NotFoundError, ConfigurationError) as e:
            raise MlflowException(
                f"{e} (this MLflow server reads MinT's store under {store.root}: set MINT_HOME "
                "for it)",
                error_code=RESOURCE_DOES_NOT_EXIST,
            ) from e
        super().__init__(str(folder), tracking_uri, registry_uri)
        self.source_uri = artifact_uri

    def log_artifact(self, local_file: str, artifact_path: str | None = None) -> None:
        raise self._read_only()

    def log_artifacts(self, local_dir: str, artifact_path: str | None = None) -> None:
        raise self._read_only()

    def log_artifact_from_stream(
        self, stream: BinaryIO, artifact_file_name: str, artifact_path: str | None = None
    ) -> None:
        raise self._read_only()

    async def log_artifact_from_async_stream(
        self,
        chunks: AsyncIterable[bytes],
        artifact_file_name: str,
        artifact_path: str | None = None,
    ) -> None:
        raise self._read_only()

    def delete_artifacts(self, artifact_path: str | None = None) -> None:
        raise self._read_only()

    def _read_only(self) -> MlflowException:
        return MlflowException(
            f"{self.source_uri} is a MinT revision, content-addressed and immutable: MLflow "
            "cannot write or delete it (MinT's release and import flows export revisions)"
        )


def _home_only(environ: Mapping[str, str]) -> dict[str, str]:
    return {"MINT_HOME": environ["MINT_HOME"]} if "MINT_HOME" in environ else {}
