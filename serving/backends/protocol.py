"""What a worker needs of an engine: the `Backend` protocol.

The worker keeps the lifecycle (catalog, admission, prewarm, the readiness gate, access); a
backend runs the model. Two implement it: `serving.backends.embedded.EmbeddedBackend`, MinT's
own torch engine and continuous-batching scheduler in the worker's process, and
`serving.backends.vllm.VllmBackend`, a vLLM OpenAI server the worker starts and supervises.

Prewarm drives a backend in two phases, with the artifact already fetched and verified:
`stage` takes the adapter into the host tier (phase 1, `fetching`), `load` makes it servable
(phase 2, `warming`, followed by a warm-up generation through `submit`). `unload` undoes both.
Keys are revision ids (`name:rN`) or `BASE`.
"""

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from mint_core.access import ANONYMOUS
from mint_core.artifacts.packing import PackedAdapter
from mint_core.model.base import BaseText
from mint_core.planning.residency import Residency
from serving.engine.generation import Generating
from serving.engine.sampling import SamplingParams
from serving.metrics import WorkerMetrics


class Backend(Protocol):
    kind: str
    """`embedded` or `vllm`: what `/health` reports."""
    text: BaseText
    """The resident base's identity, tokenizer and context length."""
    residency: Residency[Any]
    """The host tier (and device slots, where the backend places adapters itself)."""
    metrics: WorkerMetrics
    generation: int
    """Which engine runs now: 0 for the first, one more at each restart (each restart loses
    every adapter loaded before it). Backend events name it (`on_lost`)."""

    def stage(self, key: str, adapter: PackedAdapter) -> list[str]:
        """Phase 1: take a verified adapter into the host tier. Returns the keys evicted to
        make room (the worker unloads them and marks them not admitted)."""
        ...

    def load(self, key: str) -> None:
        """Phase 2: make a staged adapter servable. Raises what refused it (a MintError whose
        message says why), or EngineUnavailableError while the engine is down."""
        ...

    def unload(self, key: str) -> None:
        """Forget `key` everywhere (host tier and engine); nothing if it is not held."""
        ...

    def submit(
        self,
        prompt_ids: Sequence[int],
        key: str,
        params: SamplingParams,
        warm_up: bool = False,
        streamed: bool = True,
        principal: str = ANONYMOUS,
    ) -> Generating:
        """Start a generation for a staged and loaded `key` (or BASE); iterate the request for
        its tokens. `warm_up` marks prewarm's own generation; `streamed` False says nobody
        reads the tokens before the last (a backend may then deliver them all at once);
        `principal`: who asked, whose fair share of a busy engine it takes."""
        ...

    def problem(self) -> str | None:
        """Why the engine cannot serve right now (None while it can)."""
        ...

    def on_lost(self, callback: Callable[[int], None]) -> None:
        """Call `callback` with the engine's generation whenever that engine loses every loaded
        adapter (it died and is being restarted), before the next generation starts: the
        worker then takes them out of `ready`, admits them again, and makes nothing ready that
        warmed up on the lost generation."""
        ...

    @property
    def queue_depth(self) -> int: ...

    @property
    def batch_size(self) -> int: ...

    @property
    def request_path_loads(self) -> int:
        """Adapter loads a user's request waited for inside the engine."""
        ...

    def close(self) -> None: ...
