"""`Registry`: one MLflow store and the parts that work through it, each a field.

Like MLflow's own client, which hands each call to its registry client and that to its store:
a part gets the store and the parts it uses in its constructor and reaches no other, so what
an alias move does is read in `Aliases`, not found along an inheritance order."""

from mint_core.registry._mlflow import MlflowStore
from mint_core.registry.aliases import Aliases
from mint_core.registry.canary import Canaries
from mint_core.registry.changes import Changes
from mint_core.registry.gates import AdapterGates
from mint_core.registry.grants import Grants
from mint_core.registry.members import Members
from mint_core.registry.revisions import Revisions
from mint_core.registry.runs import Runs
from mint_core.registry.stages import Stages


class Registry:
    """MinT's operations on an MLflow tracking server, a part per field: callers reach a part
    (`registry.aliases.move(...)`, `registry.revisions.get(...)`)."""

    store: MlflowStore
    """The client (read by every part at every call) and its lookups."""
    runs: Runs
    grants: Grants
    """Who may write each adapter's registered model."""
    revisions: Revisions
    stages: Stages
    aliases: Aliases
    canary: Canaries
    gates: AdapterGates
    changes: Changes
    members: Members
    """The serving workers' heartbeats (MINT_FLEET=registry)."""

    def __init__(self, tracking_uri: str) -> None:
        self.store = MlflowStore(tracking_uri)
        self.runs = Runs(self.store)
        self.grants = Grants(self.store)
        self.revisions = Revisions(self.store, self.runs, self.grants)
        self.stages = Stages(self.store, self.revisions)
        self.aliases = Aliases(self.store, self.revisions, self.stages)
        self.canary = Canaries(self.store, self.aliases)
        self.gates = AdapterGates(self.store)
        self.changes = Changes(self.store)
        self.members = Members(self.store)

    @property
    def tracking_uri(self) -> str:
        return self.store.tracking_uri
