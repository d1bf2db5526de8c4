"""Export target: where servable artifacts live, content-addressed by revision digest.

MLflow points at artifacts here; it does not hold them. Two stores implement the Protocol: a
local folder (the default) and S3 (any S3 API: AWS, MinIO, moto). `open_store` picks the one
the configuration names.
"""

import base64
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

import boto3
from botocore.exceptions import BotoCoreError, ClientError

from mint_core.artifacts.folders import publish_folder
from mint_core.artifacts.packed_index import INDEX, PackedIndex, verify
from mint_core.config import MintConfig
from mint_core.errors import ConfigurationError, IntegrityError, NotFoundError, ServiceError


class ArtifactStore(Protocol):
    """Holds packed adapters under their content digest."""

    def put(self, folder: Path, digest: str) -> str:
        """Store a packed adapter folder; return its URI. Idempotent per digest."""
        ...

    def fetch(self, uri: str) -> Path:
        """A local folder holding the artifact at `uri`."""
        ...

    def holds(self, uri: str) -> bool:
        """Whether the store itself (not a local cache of it) has an intact, complete copy."""
        ...

    def put_file(self, name: str, path: Path) -> None:
        """Store the file at `path` as `name` (a relative path, e.g. `catalog/latest.json`),
        replacing any file of that name in one step: a reader gets the old one or the new one,
        never part of either."""
        ...

    def get_file(self, name: str, target: Path) -> bool:
        """Copy the stored file `name` to `target`; False if the store has no such file."""
        ...

    def list_files(self, folder: str) -> dict[str, float]:
        """The files `put_file` stored directly in `folder` (e.g. `catalog`), by name (as
        `put_file` takes it), each with the Unix time it was stored."""
        ...

    def delete_file(self, name: str) -> None:
        """Remove the stored file `name`; nothing if there is none. A reader copying it
        meanwhile still gets the whole file."""
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
        return self.root / "sha256" / _hex(digest)

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
        return f"{self.scheme}://sha256/{_hex(digest)}"

    def holds(self, uri: str) -> bool:
        try:
            verify(self.fetch(uri))
        except (NotFoundError, IntegrityError):
            return False
        return True

    def put_file(self, name: str, path: Path) -> None:
        target = self.root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, staging_name = tempfile.mkstemp(prefix=".put-", dir=target.parent)
        os.close(handle)
        staging = Path(staging_name)
        try:
            shutil.copyfile(path, staging)
            os.replace(staging, target)
        finally:
            staging.unlink(missing_ok=True)

    def get_file(self, name: str, target: Path) -> bool:
        stored = self.root / name
        if not stored.is_file():
            return False
        shutil.copyfile(stored, target)
        return True

    def list_files(self, folder: str) -> dict[str, float]:
        found = {}
        for path in (self.root / folder).glob("*"):
            if path.name.startswith(".put-") or not path.is_file():
                continue  # a `put_file` under way
            with suppress(FileNotFoundError):  # deleted while listed
                found[f"{folder}/{path.name}"] = path.stat().st_mtime
        return found

    def delete_file(self, name: str) -> None:
        # An open copy keeps reading the unlinked file to its end.
        (self.root / name).unlink(missing_ok=True)

    def fetch(self, uri: str) -> Path:
        parsed = urlparse(uri)
        if parsed.scheme != self.scheme:
            raise ConfigurationError(
                f"local artifact store cannot read {uri!r}; expected {self.scheme}://sha256/<hex>"
            )
        path = self.location(f"{parsed.netloc}:{parsed.path.strip('/')}")
        if not path.is_dir():
            raise NotFoundError(
                f"artifact {uri} is not in the store; re-export its revision (mint repair)"
            )
        return path


def _hex(digest: str) -> str:
    algorithm, _, hexdigest = digest.partition(":")
    if algorithm != "sha256" or len(hexdigest) != 64:
        raise ConfigurationError(f"content digest {digest!r} is not 'sha256:<64 hex>'")
    return hexdigest


class S3ArtifactStore:
    """An S3 bucket, content-addressed at two levels:

        <prefix>/shards/sha256/<hex>                 one object per shard, named by its bytes
        <prefix>/revisions/sha256/<hex>/index.json   one per revision, written last

    A revision exists once its index does, so an export killed half-way leaves nothing that
    looks complete. A shard already in the bucket is not uploaded again once its bytes hash to
    its sha256, so revisions that share shards share storage. `fetch` downloads into a local
    cache and verifies every shard against its sha256 before handing the folder out; a damaged
    shard is named, with its digest, and never cached. Nothing here trusts an object's size or
    metadata for its bytes: an object overwritten in place can keep both."""

    scheme = "s3"

    def __init__(self, bucket: str, prefix: str, endpoint_url: str | None, cache: Path) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.cache = cache
        self.s3 = boto3.client("s3", endpoint_url=endpoint_url)

    def _key(self, *parts: str) -> str:
        return "/".join((self.prefix, *parts)) if self.prefix else "/".join(parts)

    def index_key(self, digest: str) -> str:
        return self._key("revisions", "sha256", _hex(digest), INDEX)

    def shard_key(self, sha256: str) -> str:
        return self._key("shards", "sha256", _hex(sha256))

    @contextmanager
    def _service(self, action: str) -> Iterator[None]:
        """botocore's failures inside the block (the endpoint refuses or times out, the bucket
        is missing, the credentials are refused) as one ServiceError naming the endpoint, the
        bucket, the settings that name them, and the cause."""
        try:
            yield
        except (BotoCoreError, ClientError) as e:
            raise ServiceError(
                f"S3 artifact store at {self.s3.meta.endpoint_url} (MINT_S3_ENDPOINT_URL), "
                f"bucket {self.bucket!r} (MINT_S3_BUCKET), could not {action}: {e}"
            ) from e

    def put(self, folder: Path, digest: str) -> str:
        if self._intact(digest):
            return self._uri(digest)
        index = verify(folder)
        if index.content_digest != digest:
            raise IntegrityError(
                f"packed folder {folder} has content digest {index.content_digest}, export was "
                f"asked for {digest}"
            )
        with self._service(f"export {digest}"):
            for shard in index.shards:
                if self._holds(shard.sha256, shard.bytes):
                    continue  # shared with another revision, and intact
                with open(folder / shard.name, "rb") as body:
                    self.s3.put_object(
                        Bucket=self.bucket,
                        Key=self.shard_key(shard.sha256),
                        Body=body,
                        ChecksumSHA256=base64.b64encode(bytes.fromhex(_hex(shard.sha256))).decode(),
                        Metadata={"sha256": shard.sha256},
                    )
            # The index goes last: its presence is what makes the revision exist.
            self.s3.put_object(
                Bucket=self.bucket,
                Key=self.index_key(digest),
                Body=(folder / INDEX).read_bytes(),
                Metadata={"content-digest": digest},
            )
        return self._uri(digest)

    def stored_index(self, digest: str) -> PackedIndex | None:
        """The revision's index as the bucket holds it; None if it is not there."""
        key = self.index_key(digest)
        with self._service(f"read {key}"):
            try:
                body = self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()
            except ClientError as e:
                if _missing(e):
                    return None
                raise
        with tempfile.TemporaryDirectory() as scratch:
            (Path(scratch) / INDEX).write_bytes(body)
            return PackedIndex.read(Path(scratch))

    def _intact(self, digest: str) -> bool:
        """Whether the bucket holds the revision whole, every byte checked: its index and
        shards are downloaded and verified as `fetch` does (sha256 of each shard, then the
        content digest of the tensors), into a scratch folder that is then dropped."""
        self.cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".check-", dir=self.cache) as scratch:
            try:
                self._download_revision(digest, Path(scratch), self._uri(digest))
                verify(Path(scratch))
            except (NotFoundError, IntegrityError, ConfigurationError, ValueError, KeyError):
                # Missing, damaged, or an index that no longer parses: not intact.
                return False
        return True

    def _holds(self, sha256: str, size: int) -> bool:
        """Whether the bucket has this shard with these bytes: read and hashed, since an object
        overwritten in place may keep the size and the metadata MinT gave it."""
        key = self.shard_key(sha256)
        digest, read = hashlib.sha256(), 0
        with self._service(f"read {key}"):
            try:
                body = self.s3.get_object(Bucket=self.bucket, Key=key)["Body"]
            except ClientError as e:
                if _missing(e):
                    return False
                raise
            for chunk in body.iter_chunks(1 << 20):
                digest.update(chunk)
                read += len(chunk)
        return read == size and "sha256:" + digest.hexdigest() == sha256

    def _uri(self, digest: str) -> str:
        return f"s3://{self.bucket}/{self._key('revisions', 'sha256', _hex(digest))}"

    def fetch(self, uri: str) -> Path:
        digest = self.digest_of(uri)
        target = self.cache / "sha256" / _hex(digest)
        if target.is_dir():
            try:
                verify(target)
                return target
            except IntegrityError:
                shutil.rmtree(target)  # a damaged cache entry: fetch the artifact again
        with publish_folder(target, prefix=".fetch-") as staging:
            self._download_revision(digest, staging, uri)
            try:
                verify(staging)
            except IntegrityError as e:
                raise IntegrityError(f"artifact {uri} in the store is damaged: {e}") from None
        return target

    def _download_revision(self, digest: str, folder: Path, uri: str) -> None:
        """The revision's index and shards, as the bucket holds them, into `folder`."""
        self._download(self.index_key(digest), folder / INDEX, uri)
        for shard in PackedIndex.read(folder).shards:
            self._download(self.shard_key(shard.sha256), folder / shard.name, uri)

    def holds(self, uri: str) -> bool:
        return self._intact(self.digest_of(uri))

    def put_file(self, name: str, path: Path) -> None:
        # An S3 object appears whole when its upload completes, multipart or not.
        with self._service(f"store {name}"):
            self.s3.upload_file(str(path), self.bucket, self._key(name))

    def get_file(self, name: str, target: Path) -> bool:
        key = self._key(name)
        with self._service(f"read {key}"):
            try:
                self.s3.download_file(self.bucket, key, str(target))
            except ClientError as e:
                if _missing(e):
                    return False
                raise
        return True

    def list_files(self, folder: str) -> dict[str, float]:
        prefix = self._key(folder) + "/"
        found = {}
        with self._service(f"list {prefix}"):
            pages = self.s3.get_paginator("list_objects_v2")
            for page in pages.paginate(Bucket=self.bucket, Prefix=prefix, Delimiter="/"):
                for item in page.get("Contents", []):
                    name = f"{folder}/{item['Key'].removeprefix(prefix)}"
                    found[name] = item["LastModified"].timestamp()
        return found

    def delete_file(self, name: str) -> None:
        key = self._key(name)
        with self._service(f"delete {key}"):
            self.s3.delete_object(Bucket=self.bucket, Key=key)

    def digest_of(self, uri: str) -> str:
        parsed = urlparse(uri)
        expected = f"s3://{self.bucket}/{self._key('revisions', 'sha256')}/"
        if parsed.scheme != self.scheme or not uri.startswith(expected):
            raise ConfigurationError(
                f"S3 artifact store cannot read {uri!r}; expected {expected}<hex>"
            )
        return "sha256:" + uri.removeprefix(expected).strip("/")

    def _download(self, key: str, path: Path, uri: str) -> None:
        with self._service(f"read {key}"):
            try:
                self.s3.download_file(self.bucket, key, str(path))
            except ClientError as e:
                if _missing(e):
                    raise NotFoundError(
                        f"artifact {uri} is not complete in the store (s3://{self.bucket}/{key} "
                        "is missing); re-export its revision (mint repair)"
                    ) from None
                raise


def _missing(error: ClientError) -> bool:
    """Whether S3 answered that the object does not exist."""
    return error.response.get("Error", {}).get("Code") in ("404", "NoSuchKey")


def open_store(config: MintConfig) -> ArtifactStore:
    """The artifact store `config` names."""
    if config.artifact_store == "local":
        return LocalArtifactStore(config.artifact_root)
    if config.artifact_store == "s3":
        return S3ArtifactStore(
            config.s3_bucket, config.s3_prefix, config.s3_endpoint_url, config.home / "s3-cache"
        )
    raise ConfigurationError(
        f"unknown artifact store {config.artifact_store!r}; known stores: local, s3"
    )


def read_data(config: MintConfig, location: str) -> bytes:
    """The bytes of a data file: a local path, or an `s3://bucket/key` URI read with the
    artifact store's endpoint and credentials (`MINT_S3_ENDPOINT_URL`, boto3's usual chain)."""
    if not location.startswith("s3://"):
        path = Path(location).expanduser()
        if not path.is_file():
            raise NotFoundError(f"data file {location} does not exist; give a JSONL file's path")
        return path.read_bytes()
    bucket, _, key = location.removeprefix("s3://").partition("/")
    if not bucket or not key:
        raise ConfigurationError(f"{location!r} is not an s3://bucket/key URI")
    s3 = boto3.client("s3", endpoint_url=config.s3_endpoint_url)
    try:
        return s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as e:
        if _missing(e):
            raise NotFoundError(f"data file {location} does not exist in S3") from None
        raise ServiceError(f"could not read {location} (MINT_S3_ENDPOINT_URL): {e}") from e
    except BotoCoreError as e:
        raise ServiceError(f"could not read {location} (MINT_S3_ENDPOINT_URL): {e}") from e
