"""Sampling sessions: the Tinker SDK's `SamplingClient`s, served by MinT's own engine in the
trainer's process, over the very base weights the tenants train on.

A sampling session samples the base, a tenant's current weights (an ephemeral snapshot, from
`save_weights_and_get_sampling_client`, registered nowhere) or a revision that
`save_weights_for_sampler(name)` registered (its `tinker://.../sampler_weights/<name>` path;
after a restart its weights come back from the artifact store). Snapshots and revisions go
through the engine's own checks and host cache, and each sample is a generation on its
continuous-batching scheduler: the tokens and per-token logprobs a serving worker gives for the
same weights, and the logprobs the trainer computes for them (the RL loop's importance ratio
depends on that).
"""

import logging
import time
from collections import deque
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from mint_core.access import EVERYONE
from mint_core.artifacts.packing import load as load_packed
from mint_core.errors import (
    AccessDeniedError,
    ConfigurationError,
    NotFoundError,
    NotReadyError,
)
from mint_core.model.generate import FinishReason
from mint_core.registry import Registry
from mint_core.revisions import RevisionId
from serving.engine.engine import BASE, AdapterWeights
from serving.engine.lora import BASE_SLOT
from serving.engine.sampling import MAX_STOP_SEQUENCES, SamplingParams
from trainer import checkpoints
from trainer.checkpoints import SAMPLER_WEIGHTS, CheckpointPath
from trainer.errors import failure
from trainer.futures import Category
from trainer.wire import Sequence, sample_response

if TYPE_CHECKING:
    from trainer.records import Session, TrainingModel
    from trainer.service import Trainer

log = logging.getLogger(__name__)

KEPT_SNAPSHOTS = 4
"""Ephemeral samplers per training model whose weights the trainer keeps to put back into the
engine's host cache if they were evicted; older ones answer "expired" once evicted."""
MAX_SAMPLES = 64
RESULT_TIMEOUT_S = 600.0


@dataclass
class Sampler:
    id: str
    principal: str
    base_model: str
    model_path: str | None
    key: str
    """The engine key it samples (BASE for the base alone)."""
    weights: AdapterWeights | None


@dataclass(frozen=True)
class _Registered:
    """A revision `save_weights_for_sampler` registered: its weights, and who may use it."""

    revision: RevisionId
    weights: AdapterWeights
    principals: tuple[str, ...]


class Samplers:
    def __init__(self, trainer: "Trainer") -> None:
        self.trainer = trainer
        self.engine = trainer.engine
        self.residency = trainer.backend.residency
        self._by_id: dict[str, Sampler] = {}
        self._registered: dict[str, _Registered] = {}
        self._snapshots: dict[str, deque[Sampler]] = {}
        self._pool = ThreadPoolExecutor(16, thread_name_prefix="sample")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def get(self, sampler_id: str, principal: str) -> Sampler:
        sampler = self._by_id.get(sampler_id)
        if sampler is None or sampler.principal != principal:
            raise NotFoundError(f"no sampling session {sampler_id!r} is known to this trainer")
        return sampler

    def ephemeral(
        self,
        model: "TrainingModel",
        sampling_seq: int,
        adapter_config: Mapping[str, object],
        tensors: Mapping[str, torch.Tensor],
    ) -> str:
        sampler_id = f"{model.session.id}:sample:{sampling_seq}"
        key = f"tinker:{sampler_id}"
        weights = self.engine.prepare(key, adapter_config, tensors)
        self._take_in(key, weights)
        sampler = Sampler(sampler_id, model.session.principal, model.base_model, None, key, weights)
        self._by_id[sampler_id] = sampler
        kept = self._snapshots.setdefault(model.id, deque())
        kept.append(sampler)
        while len(kept) > KEPT_SNAPSHOTS:
            kept.popleft().weights = None
        return sampler_id

    def registered(
        self,
        path: CheckpointPath,
        revision: RevisionId,
        adapter_config: Mapping[str, object],
        tensors: Mapping[str, torch.Tensor],
        principals: tuple[str, ...],
    ) -> None:
        """Remember what `path` registered, with its weights (a sampler of it starts at once)."""
        weights = self.engine.prepare(str(revision), adapter_config, tensors)
        self._registered[str(path)] = _Registered(revision, weights, principals)

    def create(
        self,
        session: "Session",
        sampling_seq: int,
        model_path: str | None,
        base_model: str | None,
    ) -> str:
        """A sampling session of `model_path` (sampler weights this trainer saved) or of the
        base alone."""
        sampler_id = f"{session.id}:sample:{sampling_seq}"
        if model_path:
            path = CheckpointPath.parse(model_path)
            if path.kind != SAMPLER_WEIGHTS:
                raise ConfigurationError(
                    f"{model_path} is training state; sample from a save_weights_for_sampler path "
                    "(tinker://<model id>/sampler_weights/<name>)"
                )
            registered = self._registered.get(str(path)) or self._load(path)
            if (
                EVERYONE not in registered.principals
                and session.principal not in registered.principals
            ):
                # Only the path asked for: its revision would name the owner's adapter.
                raise AccessDeniedError(f"principal {session.principal!r} may not use {model_path}")
            key, weights = str(registered.revision), registered.weights
            self._take_in(key, weights)
        else:
            if not base_model:
                raise ConfigurationError("give model_path or base_model to sample from")
            self.trainer.check_base(base_model)
            key, weights = BASE, None
        self._by_id[sampler_id] = Sampler(
            sampler_id,
            session.principal,
            base_model or self.trainer.base.name_or_path,
            model_path,
            key,
            weights,
        )
        return sampler_id

    def _load(self, path: CheckpointPath) -> "_Registered":
        """A registered revision's weights from the artifact store (after a restart)."""
        revision = checkpoints.sampler_revision(self.trainer.store, path)
        registered = Registry(self.trainer.config.tracking_uri).revisions.get(revision)
        packed = load_packed(self.trainer.store.fetch(registered.artifact_uri))
        weights = self.engine.prepare(
            str(revision), packed.index.adapter_config, packed.peft_state_dict()
        )
        loaded = _Registered(revision, weights, registered.policy.principals)
        self._registered[str(path)] = loaded
        return loaded

    def _take_in(self, key: str, weights: AdapterWeights) -> None:
        """`weights` into the engine's host cache (ready to sample), evicting what must go."""
        for evicted in self.residency.put_host(key, weights, weights.nbytes):
            self.engine.unload(evicted)
        self.residency.settle(key)

    def sample(self, sampler: Sampler, request: Mapping[str, object], request_id: str) -> None:
        """Start the samples `request` (the SDK's `SampleRequest`) asks for; the future
        `request_id` gets them. ConfigurationError at once for a request that cannot run."""
        prompt = _prompt_tokens(request, self.trainer.vocab)
        n = int(request.get("num_samples") or 1)  # type: ignore[call-overload]
        if not 1 <= n <= MAX_SAMPLES:
            raise ConfigurationError(f"num_samples={n} must be in 1..{MAX_SAMPLES}")
        for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if request.get(name):
                raise ConfigurationError(f"{name} is not supported by mint trainer; leave it 0")
        for name in ("target_prompt_logprobs", "prompt_logprobs_last_n"):
            if request.get(name) is not None:
                raise ConfigurationError(f"{name} is not supported by mint trainer; leave it unset")
        params = _params(
            request.get("sampling_params") or {}, len(prompt), self.trainer.base.context_length
        )
        if sampler.key != BASE and not self.residency.in_host(sampler.key):
            if sampler.weights is None:
                raise NotReadyError(
                    f"sampling session {sampler.id} has expired (its weights were evicted); "
                    "save the weights for a sampler again"
                )
            self._take_in(sampler.key, sampler.weights)
        seeds = [None if params.seed is None else params.seed + i for i in range(n)]
        generations = [
            self.trainer.backend.submit(prompt, sampler.key, _with_seed(params, seed))
            for seed in seeds
        ]
        with_prompt = bool(request.get("prompt_logprobs"))

        def finish() -> None:
            try:
                results = [g.result(RESULT_TIMEOUT_S) for g in generations]
                prompt_logprobs = (
                    self._prompt_logprobs(sampler.key, prompt) if with_prompt else None
                )
            # Any failure (a generation past RESULT_TIMEOUT_S raises TimeoutError, not a MinT
            # error) must end the future: the SDK polls an unfinished one forever.
            except Exception as e:
                self.trainer.futures.finish(request_id, failure(e, "sampling", Category.SERVER))
                return
            sequences = [
                Sequence(
                    list(r.token_ids),
                    list(r.logprobs),
                    r.finish_reason in (FinishReason.EOS_TOKEN, FinishReason.STOP_SEQUENCE),
                )
                for r in results
            ]
            self.trainer.futures.finish(request_id, sample_response(sequences, prompt_logprobs))

        self._pool.submit(finish)

    def _prompt_logprobs(self, key: str, prompt: list[int]) -> list[float]:
        """Through the engine, in a device slot pinned as a request pins one."""
        if key == BASE:
            return self.engine.prompt_logprobs(prompt, BASE_SLOT)
        grant = self.residency.acquire(key)
        while grant is None:  # every slot pinned: wait as a request would
            time.sleep(0.005)
            grant = self.residency.acquire(key)
        try:
            if grant.load:
                self.engine.load(self.residency.host_weights(key), grant.slot)
            return self.engine.prompt_logprobs(prompt, grant.slot)
        finally:
            if self.residency.release(key):
                self.engine.unload(key)


def _prompt_tokens(request: Mapping[str, object], vocab: int) -> list[int]:
    prompt = request.get("prompt") or {}
    tokens: list[int] = []
    for chunk in prompt.get("chunks", []) if isinstance(prompt, Mapping) else []:
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise ConfigurationError(
                f"the prompt has a {chunk.get('type')} chunk: mint trainer samples text tokens only"
            )
        tokens.extend(int(t) for t in chunk.get("tokens", []))
    if not tokens:
        raise ConfigurationError("the prompt is empty; send at least one token")
    if bad := [t for t in tokens if not 0 <= t < vocab]:
        raise ConfigurationError(
            f"the prompt holds token {bad[0]}, outside the base's vocabulary of {vocab} tokens "
            f"(0..{vocab - 1}); tokenize with the base's own tokenizer"
        )
    return tokens


def _params(given: Mapping[str, object], prompt: int, context: int) -> SamplingParams:
    """The SDK's `SamplingParams` as the engine's: temperature 1 by default, `top_k` -1 and
    `top_p` 1 for none, `stop` as strings or token ids (`[]`: not even end-of-sequence)."""
    stop = given.get("stop")
    strings: tuple[str, ...] = ()
    token_ids: tuple[int, ...] | None = None
    if isinstance(stop, str):
        strings = (stop,)
    elif isinstance(stop, list):
        if all(isinstance(s, str) for s in stop):
            strings = tuple(stop)
        elif all(isinstance(s, int) for s in stop):
            token_ids = tuple(stop)
        else:
            raise ConfigurationError(f"stop={stop!r} mixes strings and token ids; give one kind")
        if not stop:
            token_ids = ()
    if len(strings) > MAX_STOP_SEQUENCES:
        raise ConfigurationError(f"stop has {len(strings)} strings, at most {MAX_STOP_SEQUENCES}")
    room = context - prompt
    if room < 1:
        raise ConfigurationError(
            f"the prompt's {prompt} tokens fill the base's context of {context}; shorten it"
        )
    max_tokens = given.get("max_tokens")
    top_k = int(given.get("top_k", -1) or -1)  # type: ignore[call-overload]
    top_p = float(given.get("top_p", 1.0) or 1.0)  # type: ignore[arg-type]
    seed = given.get("seed")
    return SamplingParams(
        max_new_tokens=min(int(max_tokens), room) if max_tokens else min(64, room),  # type: ignore[call-overload]
        temperature=float(given.get("temperature", 1.0)),  # type: ignore[arg-type]
        top_k=None if top_k < 0 else top_k,
        top_p=None if top_p >= 1 else top_p,
        seed=int(seed) if seed is not None else None,  # type: ignore[call-overload]
        stop=strings,
        stop_token_ids=token_ids,
    )


def _with_seed(params: SamplingParams, seed: int | None) -> SamplingParams:
    return replace(params, seed=seed)
