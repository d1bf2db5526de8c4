"""An adapter's gates in the registry: one `Gates` record (`mint_core.gates`) per adapter, kept
as a registered-model tag."""

from mint_core.gates import GATES_TAG, Gates
from mint_core.registry._mlflow import MlflowStore


class AdapterGates(MlflowStore):
    """Reading and setting what an adapter's roll-outs must pass."""

    def gates(self, adapter: str) -> Gates:
        """What `adapter`'s roll-outs must pass (defaults if none were set: no approval)."""
        raw = (self._model(adapter).tags or {}).get(GATES_TAG)
        return Gates.from_json(raw) if raw else Gates()

    def set_gates(self, adapter: str, gates: Gates) -> None:
        model = self._model(adapter, "; release its first revision, then set its gates")
        with self._failing(f"set the gates of {adapter!r}"):
            self._client.set_registered_model_tag(adapter, GATES_TAG, gates.to_json())
            # A tag leaves the model's last-updated time as it was: touching the description
            # (unchanged) moves it, so workers see new replicas at their next sync.
            self._client.update_registered_model(adapter, description=model.description or "")
