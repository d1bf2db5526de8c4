"""MinT's own engine as a `Backend`: the torch engine and its continuous-batching scheduler,
in the worker's process.

Staging verifies an adapter against the base and keeps its LoRA pairs in the host cache;
device slots are taken on demand by the scheduler (a warm-up generation or a user's request
copies the pairs into a slot), so `load` has nothing left to do.
"""

from collections.abc import Callable, Sequence

from mint_core.access import ANONYMOUS
from mint_core.artifacts.packing import PackedAdapter
from mint_core.config import BackendKind
from mint_core.planning.residency import Residency
from serving.engine.engine import AdapterWeights, TorchEngine
from serving.engine.generation import Generating
from serving.engine.sampling import SamplingParams
from serving.engine.scheduler import DEFAULT_MAX_BATCH, Scheduler
from serving.metrics import WorkerMetrics


class EmbeddedBackend:
    kind = BackendKind.EMBEDDED.value
    generation = 0  # it runs in the worker's own process: it never restarts without the worker

    def __init__(
        self,
        engine: TorchEngine,
        host_cache_bytes: int,
        max_batch: int = DEFAULT_MAX_BATCH,
        host_adapters: int | None = None,
        weight: Callable[[str], float] = lambda _: 1.0,
    ) -> None:
        """`weight`: each principal's fair share of a busy batch (`mint_core.tenancy`)."""
        self.engine = engine
        self.text = engine.base.text
        self.residency: Residency[AdapterWeights] = Residency(
            host_cache_bytes, engine.slots, host_adapters
        )
        self.metrics = WorkerMetrics(self.residency)
        self.scheduler = Scheduler(engine, self.residency, self.metrics, max_batch, weight)

    def stage(self, key: str, adapter: PackedAdapter) -> list[str]:
        weights = self.engine.prepare(key, adapter.index.adapter_config, adapter.peft_state_dict())
        return self.residency.put_host(key, weights, weights.nbytes)

    def load(self, key: str) -> None:
        """Nothing to do: the warm-up generation copies the adapter into a device slot."""

    def unload(self, key: str) -> None:
        # A slot a running request pins stays: the request finishes on the weights it started,
        # and they leave at its release (the scheduler then frees the engine's slot).
        if self.residency.leave(key) or not self.residency.in_host(key):
            self.engine.unload(key)

    def submit(
        self,
        prompt_ids: Sequence[int],
        key: str,
        params: SamplingParams,
        warm_up: bool = False,
        streamed: bool = True,
        principal: str = ANONYMOUS,
    ) -> Generating:
        # Tokens come one step at a time whether or not anyone reads them as they come.
        return self.scheduler.submit(list(prompt_ids), key, params, warm_up, principal)

    def problem(self) -> str | None:
        return None  # it runs in the worker's own process: if it is down, so is the worker

    def on_lost(self, callback: Callable[[int], None]) -> None:
        """Never called: the engine cannot lose its adapters while the worker lives."""

    @property
    def queue_depth(self) -> int:
        return self.scheduler.queue_depth

    @property
    def batch_size(self) -> int:
        return self.scheduler.batch_size

    @property
    def request_path_loads(self) -> int:
        return self.scheduler.request_path_loads

    def close(self) -> None:
        self.scheduler.stop()
