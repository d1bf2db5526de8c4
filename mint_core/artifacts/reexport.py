"""Serving a registered revision again when its artifact is missing or damaged in the store:
re-pack it from its frozen files and check the result is what was registered. Never retrain.

Packing may differ from the first export (shard size, a newer packer): the content digest names
the tensors, not their packing, so it is what a re-pack is checked against.
"""

from pathlib import Path

from mint_core.artifacts.freezing import FrozenAdapter, open_frozen
from mint_core.artifacts.packed_index import PackedIndex
from mint_core.errors import IntegrityError, NotFoundError
from mint_core.revisions import PolicyRecord, RevisionId


def frozen_files(
    revision: RevisionId, policy: PolicyRecord, artifact_uri: str, frozen_root: Path
) -> FrozenAdapter:
    """The frozen files `revision` was registered from, under `frozen_root`; NotFoundError if
    they are gone (its artifact, at `artifact_uri`, being lost too)."""
    frozen_digest = policy.frozen_digest
    frozen_path = frozen_root / (frozen_digest or "").removeprefix("sha256:")
    if not frozen_digest or not frozen_path.is_dir():
        raise NotFoundError(
            f"{revision} cannot be served again: its artifact is missing or damaged in the "
            f"store ({artifact_uri}) and its "
            f"frozen files ({frozen_digest}) are gone from {frozen_root}; release a new "
            "revision instead"
        )
    return open_frozen(frozen_path)


def check_repacked(
    revision: RevisionId, policy: PolicyRecord, frozen: FrozenAdapter, index: PackedIndex
) -> None:
    """IntegrityError unless re-packing `frozen` gave the content `policy` records."""
    if index.content_digest != policy.content_digest:
        raise IntegrityError(
            f"re-packing {revision} from {frozen.path} gave content {index.content_digest}, "
            f"the policy record says {policy.content_digest}: its frozen files are "
            "not what was registered; release a new revision instead"
        )
