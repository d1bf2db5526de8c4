"""The MLflow model registry as MinT's source of truth.

Registered model = adapter, model version = revision (`rN` is the version number), version tags
= policy record and stage, aliases = what users get. Registering writes metadata only: the
weights stay in the artifact store and the version's `source` points at them.

A revision's life here, one module per part, each a field of one `Registry` (`client`) over
one shared `MlflowStore`:

1. `runs`: training records its hyperparameters, dataset and loss curve in an MLflow run.
2. `revisions`: `register` makes the model version, the policy record as its tags; `resolve`
   turns `name:rN` or `name@alias` into a `RegisteredRevision`.
3. `stages`: each step of the pipeline moves its stage (checked against `states.Stage`'s
   table), appended to its stage history (`stage_log`), which starts with the steps before
   registration (trained, frozen, packed, exported) and their times.
4. `aliases`: `activate` walks a ready revision to `active` and moves `production` to it,
   recording the move in the adapter's alias history (`moves`) and as an intent workers follow;
   every alias move needs the adapter's roll-out slot (`slots`), held.
5. `canary`, `gates`: a candidate's share of live traffic, and what its roll-outs must pass.
6. `changes`: what workers read at each sync to follow all of this.
7. `members`: the serving workers announcing themselves (MINT_FLEET=registry), one run each in
   the `mint-fleet` experiment, never a registered model.

`_mlflow` holds the store (the client), the tag names and the one translation of MLflow's
failures into MinT's errors.
"""

from mint_core.registry._mlflow import (
    ACTIVATED_AT_TAG,
    ALIAS_MOVE_TAG,
    APPROVAL_RUN_TAG,
    CANARY_PERCENT_TAG,
    EXPERIMENT_KIND_TAG,
    FAILURE_TAG,
    HOST_RUN_TAG,
    KIND_TAG,
    MODEL_DEVELOPMENT,
    REVISION_RUN_TAG,
    STAGE_HISTORY_TAG,
    STAGE_TAG,
)
from mint_core.registry.aliases import ACTIVATABLE, check_activatable
from mint_core.registry.canary import check_canary_percent
from mint_core.registry.changes import MODELS_PAGE_MAX, AdapterAliases
from mint_core.registry.client import Registry
from mint_core.registry.moves import AliasMove, MoveRecord, moves_made
from mint_core.registry.revisions import VERSIONS_PAGE, RegisteredRevision
from mint_core.registry.runs import DatasetLog
from mint_core.registry.slots import RolloutSlot, held_slot
from mint_core.registry.stage_log import StageMark

__all__ = [
    "ACTIVATABLE",
    "ACTIVATED_AT_TAG",
    "ALIAS_MOVE_TAG",
    "APPROVAL_RUN_TAG",
    "CANARY_PERCENT_TAG",
    "EXPERIMENT_KIND_TAG",
    "FAILURE_TAG",
    "HOST_RUN_TAG",
    "KIND_TAG",
    "MODELS_PAGE_MAX",
    "MODEL_DEVELOPMENT",
    "REVISION_RUN_TAG",
    "STAGE_HISTORY_TAG",
    "STAGE_TAG",
    "VERSIONS_PAGE",
    "AdapterAliases",
    "AliasMove",
    "DatasetLog",
    "MoveRecord",
    "RegisteredRevision",
    "Registry",
    "RolloutSlot",
    "StageMark",
    "check_activatable",
    "check_canary_percent",
    "held_slot",
    "moves_made",
]
