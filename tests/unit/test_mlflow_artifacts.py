"""MLflow reads MinT's local store: `mint-local://` model-version sources resolve, through the
artifact repository MinT registers with MLflow, to the revision's files, read-only."""

from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException
from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

from mint_core.artifacts.mlflow_repository import MintLocalArtifactRepository
from mint_core.artifacts.stores import LocalArtifactStore

DIGEST = "sha256:" + "ab" * 32


@pytest.fixture
def stored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A revision's folder in the local store under MINT_HOME; its URI. The environment is an
    MLflow server's: its MLFLOW_TRACKING_URI is its backend store, not a MinT setting."""
    monkeypatch.setenv("MINT_HOME", str(tmp_path))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    store = LocalArtifactStore(tmp_path / "artifacts")
    folder = store.location(DIGEST)
    folder.mkdir(parents=True)
    (folder / "index.json").write_text("{}")
    (folder / "shard-00000.safetensors").write_bytes(b"\0" * 10)
    return f"mint-local://sha256/{'ab' * 32}"


def test_lists_and_downloads_a_revisions_files(stored: str, tmp_path: Path) -> None:
    repository = MintLocalArtifactRepository(stored)
    listed = {(f.path, f.is_dir, f.file_size) for f in repository.list_artifacts()}
    assert listed == {("index.json", False, 2), ("shard-00000.safetensors", False, 10)}
    (tmp_path / "out").mkdir()
    copy = repository.download_artifacts("index.json", str(tmp_path / "out"))
    assert Path(copy).read_text() == "{}"


def test_mlflow_finds_it_by_the_scheme(stored: str) -> None:
    # Through MLflow's own registry of schemes, which reads the installed entry points (the
    # MLflow server does the same): the editable install must be current (`make`).
    assert isinstance(get_artifact_repository(stored), MintLocalArtifactRepository)


def test_refuses_writes_and_names_a_missing_revision(stored: str, tmp_path: Path) -> None:
    repository = MintLocalArtifactRepository(stored)
    with pytest.raises(MlflowException, match="immutable"):
        repository.log_artifact(str(tmp_path / "artifacts" / "sha256" / ("ab" * 32) / "index.json"))
    with pytest.raises(MlflowException, match="immutable"):
        repository.delete_artifacts()
    missing = f"mint-local://sha256/{'cd' * 32}"
    with pytest.raises(MlflowException, match=r"not in the store.*MINT_HOME") as raised:
        MintLocalArtifactRepository(missing)
    assert raised.value.error_code == "RESOURCE_DOES_NOT_EXIST"
