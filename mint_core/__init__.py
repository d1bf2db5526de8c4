"""MinT's domain: how a LoRA adapter becomes a served revision, with no Prefect and no HTTP.

A revision's life, one module per step:

1. `training`: a PEFT LoRA is trained on a private copy of the resident base (`base_model`),
   or `imports` checks one trained elsewhere against that base, tensor by tensor.
2. `freezing`: its files are copied read-only under their digest; the bytes never change again.
3. `packing`: its tensors go into safetensors shards plus an index with per-shard digests.
4. `artifact_store`: the packed artifact is exported, content-addressed (a local folder or S3).
5. `registry`: an MLflow model version (= revision `rN`) records the policy record
   (`revisions.PolicyRecord`) as tags and as a JSON artifact; no user can reach it yet.
6. Workers follow the registry through a `catalog`, admit it (`admission`: K at a time,
   rollbacks first), prewarm it into their `residency` tiers (host cache, then a device slot)
   and report it ready (`states.Readiness`); once all do, the `production` alias moves to it
   and users get it. `states.Stage` tracks each step.
"""

from mint_core.base_model import BaseModel, BaseModelSpec, load_base
from mint_core.config import MintConfig
from mint_core.errors import MintError
from mint_core.registry import RegisteredRevision, Registry
from mint_core.revisions import PolicyRecord, RevisionId, RevisionRef
from mint_core.states import Readiness, Stage, transition

__all__ = [
    "BaseModel",
    "BaseModelSpec",
    "MintConfig",
    "MintError",
    "PolicyRecord",
    "Readiness",
    "RegisteredRevision",
    "Registry",
    "RevisionId",
    "RevisionRef",
    "Stage",
    "load_base",
    "transition",
]
