"""Pull: any registered revision's files, out of the artifact store, as a PEFT adapter folder
that tools outside MinT load (`AutoPeftModelForCausalLM.from_pretrained(folder)`, vLLM's
`--lora-modules`, TGI's `LORA_ADAPTERS`).

The revision's packed artifact is fetched, verified (every shard's sha256, then the content
digest over the config and every tensor, which must be the one its policy record names), and
unpacked into PEFT's layout: the exact adapter config and bit-identical tensors that were
frozen. The folder appears whole or not at all.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from mint_core.artifacts.folders import publish_folder
from mint_core.artifacts.freezing import PEFT_CONFIG
from mint_core.artifacts.packing import load, verify, write_peft
from mint_core.artifacts.stores import ArtifactStore
from mint_core.errors import ConfigurationError, IntegrityError
from mint_core.registry import Registry
from mint_core.revisions import RevisionId, RevisionRef


@dataclass(frozen=True)
class Pulled:
    """What `pull` wrote."""

    revision: RevisionId
    folder: Path
    content_digest: str
    """Verified against the revision's policy record."""
    base: str
    """`base_model_name_or_path` in the folder's adapter config: the base PEFT loads."""


def pull(
    registry: Registry,
    store: ArtifactStore,
    ref: RevisionRef,
    out_dir: Path,
    base: str | None = None,
) -> Pulled:
    """Write the revision `ref` names (`name:rN` or `name@alias`, resolved now) into `out_dir`
    as a verified PEFT folder. `base` replaces the base the adapter config records (revisions
    trained before configs recorded the base's full path name only its folder). `out_dir` must
    be absent or empty: nothing is overwritten."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ConfigurationError(
            f"{out_dir} already exists and is not an empty folder; pull into a new folder"
        )
    revision = registry.revisions.resolve(ref)
    packed = store.fetch(revision.artifact_uri)
    index = verify(packed)
    if index.content_digest != revision.policy.content_digest:
        raise IntegrityError(
            f"the artifact of {revision.id} ({revision.artifact_uri}) holds content "
            f"{index.content_digest}, its policy record says {revision.policy.content_digest}; "
            f"export it again: mint repair --adapter {revision.id.adapter} --revision "
            f"{revision.id.number}"
        )
    with publish_folder(out_dir, prefix=f".{out_dir.name}-pull-") as staging:
        write_peft(load(packed), staging)
        config_path = staging / PEFT_CONFIG
        config = json.loads(config_path.read_text())
        if base is not None:
            config["base_model_name_or_path"] = base
            config_path.write_text(json.dumps(config, indent=2, sort_keys=True))
    return Pulled(
        revision.id, out_dir, index.content_digest, str(config.get("base_model_name_or_path"))
    )
