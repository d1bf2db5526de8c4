"""An adapter's gates in the registry: one `Gates` record (`mint_core.gates`) per adapter, kept
as a registered-model tag."""

from dataclasses import dataclass

from mint_core.gates import GATES_TAG, Gates
from mint_core.registry._mlflow import MlflowStore


@dataclass(frozen=True)
class AdapterGates:
    """Reading and setting what an adapter's roll-outs must pass."""

    store: MlflowStore

    def of(self, adapter: str) -> Gates:
        """What `adapter`'s roll-outs must pass (defaults if none were set: no approval)."""
        raw = (self.store.model(adapter).tags or {}).get(GATES_TAG)
        return Gates.from_json(raw) if raw else Gates()

    def set(self, adapter: str, gates: Gates) -> None:
        model = self.store.model(adapter, "; release its first revision, then set its gates")
        with self.store.failing(f"set the gates of {adapter!r}"):
            self.store.client.set_registered_model_tag(adapter, GATES_TAG, gates.to_json())
            # A tag leaves the model's last-updated time as it was: touching the description
            # (unchanged) moves it, so workers see new replicas at their next sync.
            self.store.client.update_registered_model(adapter, description=model.description or "")
