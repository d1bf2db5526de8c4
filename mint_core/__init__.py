"""MinT's domain: how a LoRA adapter becomes a served revision, with no Prefect and no HTTP.

A revision's life, one module per step (`shipping` runs steps 2 to 5 in order):

1. `model`: the base is the user's Hugging Face model folder (`model.base`); a PEFT LoRA is
   trained on it from the user's JSONL rows (`model.datasets`, `model.training`), or
   `model.imports` checks one trained elsewhere against it, tensor by tensor.
2. `artifacts.freezing`: its files are copied read-only under their digest; the bytes never
   change again.
3. `artifacts.packing`: its tensors go into safetensors shards plus an index with per-shard
   digests.
4. `artifacts.stores`: the packed artifact is exported, content-addressed (a local folder or S3).
5. `registry`: an MLflow model version (= revision `rN`) records the policy record
   (`revisions.PolicyRecord`) as tags and as a JSON artifact; no user can reach it yet.
6. Workers follow the registry through a `catalog`, admit it (`planning.admission`: K at a
   time, rollbacks first), prewarm it into their `planning.residency` tiers (host cache, then
   a device slot) and report it ready (`states.Readiness`); once all do, the `production`
   alias moves to it and users get it. `states.Stage` tracks each step.

The names below are imported on first use, not with the package: `mint_core.model` brings
torch and transformers and `mint_core.registry` brings MLflow (seconds), which a command such as
`mint --help` that needs neither should not wait for.
"""

import importlib

_MODULE_OF = {
    "BaseModel": "model.base",
    "BaseSource": "model.base",
    "load_base": "model.base",
    "MintConfig": "config",
    "MintError": "errors",
    "RegisteredRevision": "registry",
    "Registry": "registry",
    "PolicyRecord": "revisions",
    "RevisionId": "revisions",
    "RevisionRef": "revisions",
    "Readiness": "states",
    "Stage": "states",
    "transition": "states",
}
"""Each public name -> the module of `mint_core` that defines it."""

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> object:
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'mint_core' has no attribute {name!r}")
    return getattr(importlib.import_module(f"mint_core.{_MODULE_OF[name]}"), name)
