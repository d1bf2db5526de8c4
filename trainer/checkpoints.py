"""Where a tenant's weights go: training state in the artifact store, sampler weights as MinT
revisions.

- `save_state(name)` writes the adapter and its AdamW state as one file in the artifact store
  (`trainer/checkpoints/<model>/<name>.pt`), so it survives a restart of `mint trainer` and
  any trainer sharing the store can load it. Its path is `tinker://<model id>/weights/<name>`.
  The state records the principal that saved it: only that principal and admins load it
  (`check_loader`), whoever learns its path.
- `save_weights_for_sampler(name)` ships the adapter as the next revision of the tenant's
  adapter: freeze, pack, export, register, the release pipeline's own steps (its policy record
  names the base, the optimizer steps taken, the session as lineage and the principal as who
  may use it). Registering is invisible to users; activating it is MinT's lifecycle. Its path
  is `tinker://<model id>/sampler_weights/<name>`, recorded in the store beside the state.
"""

import hashlib
import io
import json
import re
import tempfile
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from mint_core.access import allows
from mint_core.artifacts.freezing import PEFT_CONFIG, PEFT_WEIGHTS
from mint_core.artifacts.stores import ArtifactStore
from mint_core.config import MintConfig
from mint_core.errors import AccessDeniedError, ConfigurationError, NotFoundError, clip
from mint_core.model.base import BaseText
from mint_core.model.training import TrainedAdapter, TrainingConfig
from mint_core.registry import Registry
from mint_core.revisions import RevisionId, RevisionRef
from mint_core.shipping import Shipment, ship

SCHEME = "tinker://"
WEIGHTS = "weights"
SAMPLER_WEIGHTS = "sampler_weights"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", re.ASCII)
_MODEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9:._-]{0,127}", re.ASCII)
"""A training model's id (`s-<hex>:train:<seq>`), bounded: it names a folder in the store."""


@dataclass(frozen=True)
class CheckpointPath:
    """`tinker://<model id>/<weights|sampler_weights>/<name>`."""

    model_id: str
    kind: str
    name: str

    @classmethod
    def parse(cls, path: str) -> "CheckpointPath":
        parts = path.removeprefix(SCHEME).split("/") if path.startswith(SCHEME) else []
        # Checked before the path names any file: a model id or name longer than a file name
        # may be, or one the trainer never makes, is no checkpoint of this trainer.
        if (
            len(parts) != 3
            or parts[1] not in (WEIGHTS, SAMPLER_WEIGHTS)
            or not _MODEL_ID.fullmatch(parts[0])
            or not _NAME.fullmatch(parts[2])
        ):
            raise ConfigurationError(
                f"path {clip(repr(path))} is not a checkpoint path of this trainer; give one "
                "that save_state or save_weights_for_sampler returned "
                "(tinker://<model id>/weights/<name>)"
            )
        return cls(*parts)

    def __str__(self) -> str:
        return f"{SCHEME}{self.model_id}/{self.kind}/{self.name}"

    @property
    def stored_name(self) -> str:
        """The file's name in the artifact store."""
        folder = re.sub(r"[^A-Za-z0-9._-]", "_", self.model_id)
        suffix = ".pt" if self.kind == WEIGHTS else ".json"
        return f"trainer/{self.kind}/{folder}/{self.name}{suffix}"


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ConfigurationError(
            f"path: checkpoint name {clip(repr(name))} is not valid; use letters, digits, '.', "
            "'_' or '-' (at most 128, starting with a letter or digit)"
        )
    return name


@dataclass(frozen=True)
class State:
    """What `save_state` stores: the LoRA (PEFT names), its config, and optionally AdamW's."""

    adapter_config: dict[str, object]
    tensors: dict[str, torch.Tensor]
    optimizer: dict[str, object] | None
    base_digest: str
    steps: int
    targets: tuple[str, ...]
    """The module names the LoRA adapts (full names)."""
    owner: str | None
    """The principal that saved it; None for a state saved before states recorded their owner."""


def check_loader(
    state: State, path: CheckpointPath, principal: str, admins: Collection[str], keyed: bool
) -> None:
    """Refuse `principal` a state it did not save unless it is an admin. A state with no owner
    recorded loads only for admins, or for anyone on a trainer without keys (`keyed` False: every
    caller is `anonymous`, so there is one tenant). The refusal names only the path asked for,
    as a refused sampler path does: never the owner or what the state holds."""
    if principal in admins or principal == state.owner:
        return
    if state.owner is None and not keyed:
        return
    why = f"principal {principal!r} may not load {path}"
    if state.owner is None:
        why += (
            "; it was saved before training states recorded who saved them, so only an admin "
            "(a key whose principal is in MINT_ADMIN_PRINCIPALS) may load it"
        )
    raise AccessDeniedError(why)


def save_state(store: ArtifactStore, path: CheckpointPath, state: State) -> None:
    buffer = io.BytesIO()
    torch.save(
        {
            "adapter_config": state.adapter_config,
            "tensors": state.tensors,
            "optimizer": state.optimizer,
            "base_digest": state.base_digest,
            "steps": state.steps,
            "targets": list(state.targets),
            "owner": state.owner,
        },
        buffer,
    )
    _put(store, path.stored_name, buffer.getvalue())


def load_state(store: ArtifactStore, path: CheckpointPath) -> State:
    """The state saved at `path`; NotFoundError if the store has none."""
    data = _get(store, path.stored_name)
    if data is None:
        raise NotFoundError(f"no checkpoint {path} is in the artifact store")
    saved = torch.load(io.BytesIO(data), weights_only=True)
    return State(
        saved["adapter_config"],
        saved["tensors"],
        saved["optimizer"],
        saved["base_digest"],
        saved["steps"],
        tuple(saved["targets"]),
        saved.get("owner"),  # absent from states saved before owners were recorded
    )


@dataclass(frozen=True)
class Snapshot:
    """A tenant's adapter at one moment, to ship as a revision."""

    adapter: str
    adapter_config: dict[str, object]
    tensors: dict[str, torch.Tensor]
    target_modules: tuple[str, ...]
    rank: int
    alpha: int
    steps: int
    learning_rate: float
    session_id: str
    principal: str


def check_writer(registry: Registry, adapter: str, principal: str, admins: Collection[str]) -> None:
    """Refuse `principal` a new revision of `adapter` unless it may use the adapter's newest
    revision (or is an admin): a tenant's `mint_adapter` may name a new adapter or one of its
    own, never another tenant's line. The refusal names only the adapter."""
    if principal in admins:
        return
    try:
        revisions = registry.revisions.of(adapter)
    except NotFoundError:  # a new adapter
        return
    if revisions and not allows(revisions[-1].policy, principal):
        raise AccessDeniedError(
            f"principal {principal!r} may not add revisions to adapter {adapter!r}; name an "
            "adapter of its own (user_metadata mint_adapter)"
        )


def ship_snapshot(config: MintConfig, base: BaseText, snapshot: Snapshot) -> RevisionId:
    """Register `snapshot` as the next revision of its adapter, through the release pipeline's
    own steps (`mint_core.shipping`, as plain functions: no flow run), once its principal may
    add to it. Its stage history starts at `registered`, as sampler revisions always have."""
    registry = Registry(config.tracking_uri)
    check_writer(registry, snapshot.adapter, snapshot.principal, config.admin_principals)

    folder = config.work_root / "trainer" / uuid.uuid4().hex
    folder.mkdir(parents=True)
    save_file(snapshot.tensors, folder / PEFT_WEIGHTS, metadata={"format": "pt"})
    (folder / PEFT_CONFIG).write_text(json.dumps(snapshot.adapter_config, indent=2))
    lineage = f"tinker session {snapshot.session_id}"
    source = TrainedAdapter(
        path=folder,
        config=TrainingConfig(
            rank=snapshot.rank,
            alpha=snapshot.alpha,
            target_modules=snapshot.target_modules,
            expert_targets=(),
            learning_rate=snapshot.learning_rate,
            steps=max(snapshot.steps, 1),
        ),
        target_modules=snapshot.target_modules,
        target_parameters=(),
        base_model_id=base.model_id,
        base_digest=base.digest,
        dataset=lineage,
        dataset_digest="sha256:" + hashlib.sha256(lineage.encode()).hexdigest(),
        steps=snapshot.steps,
        losses=(),
    )
    shipment = Shipment(snapshot.adapter, source, snapshot.principal, (snapshot.principal,))
    return ship(config, shipment, record_steps=False)


def record_sampler(store: ArtifactStore, path: CheckpointPath, revision: RevisionId) -> None:
    _put(store, path.stored_name, json.dumps({"revision": str(revision)}).encode())


def sampler_revision(store: ArtifactStore, path: CheckpointPath) -> RevisionId:
    """The revision `save_weights_for_sampler` registered for `path`."""
    data = _get(store, path.stored_name)
    if data is None:
        raise NotFoundError(f"no sampler weights {path} were saved on this trainer's store")
    ref = RevisionRef.parse(json.loads(data)["revision"])
    return RevisionId(ref.adapter, ref.revision or 0)


def _put(store: ArtifactStore, name: str, data: bytes) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        file = Path(scratch) / "file"
        file.write_bytes(data)
        store.put_file(name, file)


def _get(store: ArtifactStore, name: str) -> bytes | None:
    with tempfile.TemporaryDirectory() as scratch:
        file = Path(scratch) / "file"
        return file.read_bytes() if store.get_file(name, file) else None
