"""Export target: where servable artifacts live, content-addressed by revision digest.

MLflow points at artifacts here; it does not hold them. A store is a Protocol so that an S3
store can stand beside the local folder; stores are chosen by name from `STORES`.
"""

import os
import shutil
import tempfile
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

from mint_core.errors import ConfigurationError, IntegrityError, NotFoundError
from mint_core.packing import verify


class ArtifactStore(Protocol):
    """Holds packed adapters under their content digest."""

    def put(self, folder: Path, digest: str) -> str:
        """Store a packed adapter folder; return its URI. Idempotent per digest."""
        ...

    def fetch(self, uri: str) -> Path:
        """A local folder holding the artifact at `uri` (not yet verified)."""
        ...


class LocalArtifactStore:
    """A folder: `<root>/sha256/<hex>/` per revision, written atomically, never overwritten
    while the copy in place is good.

    URIs are `mint-local://sha256/<hex>`: they name the content, not the folder, so every
    process resolves them under its own configured root (MLflow also refuses plain local paths
    as model-version sources)."""

    scheme = "mint-local"

    def __init__(self, root: Path) -> None:
        self.root = root

    def location(self, digest: str) -> Path:
        algorithm, _, hexdigest = digest.partition(":")
        if algorithm != "sha256" or len(hexdigest) != 64:
            raise ConfigurationError(f"content digest {digest!r} is not 'sha256:<64 hex>'")
        return self.root / algorithm / hexdigest

    def put(self, folder: Path, digest: str) -> str:
        target = self.location(digest)
        if target.exists():
            try:
                verify(target)
                return self._uri(digest)
            except IntegrityError:
                # The copy in place is damaged; the fresh one replaces it below.
                pass
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".export-", dir=target.parent))
        try:
            shutil.copytree(folder, staging, dirs_exist_ok=True)
            index = verify(staging)
            if index.content_digest != digest:
                raise IntegrityError(
                    f"packed folder {folder} has content digest {index.content_digest}, "
                    f"export was asked for {digest}"
                )
            if target.exists():
                shutil.rmtree(target)
            os.rename(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return self._uri(digest)

    def _uri(self, digest: str) -> str:
        algorithm, _, hexdigest = digest.partition(":")
        return f"{self.scheme}://{algorithm}/{hexdigest}"

    def fetch(self, uri: str) -> Path:
        parsed = urlparse(uri)
        if parsed.scheme != self.scheme:
            raise ConfigurationError(
                f"local artifact store cannot read {uri!r}; expected {self.scheme}://sha256/<hex>"
            )
        path = self.location(f"{parsed.netloc}:{parsed.path.strip('/')}")
        if not path.is_dir():
            raise NotFoundError(f"artifact {uri} is not in the store; export the revision again")
        return path


STORES = {"local": LocalArtifactStore}


def open_store(name: str, root: Path) -> ArtifactStore:
    try:
        factory = STORES[name]
    except KeyError:
        raise ConfigurationError(
            f"unknown artifact store {name!r}; known stores: {', '.join(sorted(STORES))}"
        ) from None
    return factory(root)
