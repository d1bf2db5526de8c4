"""`mint trainer`: one resident base, many tenants training LoRAs on it through the Tinker API.

The service keeps sessions (one per SDK `ServiceClient`), training models (a tenant's LoRA and
its AdamW state) and sampling sessions. Every call that does work is queued on its model in
`seq_id` order (`trainer.sequencing`) and answered by a future (`trainer.futures`). One thread
runs the work: each round, the forward/backward requests every model may run now go through
the base together (`trainer.compute`; when tenants want more than a pass, each its weighted
share of one, by the tenancy file's weights), then each model's next other request (optimizer
step, save, load). Sampling runs on MinT's serving engine in this process (`trainer.sampling`),
over the same base weights.

A tenant's error fails that request's future alone (category `user` for a bad request); a
tenant is bounded in rank (`trainer_max_rank`), in models (`trainer_models`) and in requests
waiting (`trainer_queue`: more are refused with `QueueFull`, which the API answers 429).
"""

import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from itertools import takewhile
from pathlib import Path

import torch

from mint_core.artifacts.stores import open_store
from mint_core.config import MintConfig
from mint_core.errors import ConfigurationError, NotFoundError
from mint_core.model.base import BaseModel
from mint_core.revisions import check_adapter_name
from mint_core.tenancy import TenancyFile
from serving.backends.embedded import EmbeddedBackend
from serving.engine.engine import TorchEngine
from trainer import checkpoints
from trainer.checkpoints import SAMPLER_WEIGHTS, WEIGHTS, CheckpointPath
from trainer.compute import Work, check_request, plan_passes, run_pass
from trainer.errors import QueueFull, failure
from trainer.futures import Category, Futures
from trainer.lora import ALPHA, Layers, Router, Targets, TenantLora, wrap
from trainer.records import AdamParams, SamplerSave, Session, TrainingModel
from trainer.sampling import Samplers
from trainer.sequencing import Op, OpKind, round_share
from trainer.wire import ForwardBackward, forward_backward_output

log = logging.getLogger(__name__)

GATHER_S = 0.02
"""How long a round waits for the forward/backward requests of tenants that are training (sent
one within `ACTIVE_S`) but have none waiting yet: a tenant that keeps up sends its next batch
within milliseconds of its last answer, and then shares the pass instead of waiting a round."""
ACTIVE_S = 1.0
SESSION_TIMEOUT_S = 120.0
"""A session whose client has not been heard from for this long (the SDK sends a heartbeat
every 10 s) is finished as `expired`, and its models' memory freed."""


class Trainer:
    def __init__(self, config: MintConfig, base: BaseModel, futures: Futures) -> None:
        self.config = config
        self.base = base
        self.futures = futures
        self.store = open_store(config)
        self.tenancy = TenancyFile(config.tenancy_file)
        """Each principal's weight in a round that cannot take every tenant's requests."""
        # Read the layers before the engine wraps them; the trainer's wrappers go on top.
        self.layers = Layers.of(base.model)
        self.engine = TorchEngine(base, config.device_slots)
        self.backend = EmbeddedBackend(
            self.engine, config.host_cache_mb * 2**20, config.max_batch, config.host_adapters
        )
        self.router = Router()
        wrap(base.model, self.layers.shapes, self.router)
        self.vocab = int(base.model.get_input_embeddings().num_embeddings)
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, TrainingModel] = {}
        self.samplers = Samplers(self)
        self._work = threading.Condition()
        self._stopped = False
        self._shipping = ThreadPoolExecutor(1, thread_name_prefix="ship")
        self._thread = threading.Thread(target=self._loop, name="trainer", daemon=True)
        self._thread.start()

    # Sessions and models.

    def create_session(self, principal: str, adapter: str | None = None) -> Session:
        session = Session(f"s-{uuid.uuid4().hex[:12]}", principal, _checked(adapter))
        with self._work:
            self.sessions[session.id] = session
        return session

    def session(self, session_id: str, principal: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None or session.principal != principal:
            raise NotFoundError(f"no session {session_id!r} is known to this trainer")
        if session.finished is not None:
            raise ConfigurationError(
                f"session {session_id} is finished ({session.finished}); start a new ServiceClient"
            )
        session.last_seen = time.monotonic()
        return session

    def finish_session(self, session_id: str, principal: str, reason: str) -> None:
        session = self.session(session_id, principal)
        with self._work:
            session.finished = reason or "finished"
            for model_id in [m for m, model in self.models.items() if model.session is session]:
                self._drop_model(model_id, f"its session {session_id} finished")

    def model(self, model_id: str, principal: str) -> TrainingModel:
        model = self.models.get(model_id)
        if model is None or model.session.principal != principal:
            raise NotFoundError(
                f"no training model {model_id!r} is known to this trainer; create it with "
                "create_lora_training_client first"
            )
        return model

    def create_model(
        self,
        session_id: str,
        model_seq_id: int,
        principal: str,
        base_model: str,
        rank: int,
        targets: Targets | tuple[str, ...],
        seed: int | None,
        adapter: str | None = None,
    ) -> TrainingModel:
        """A new LoRA on the base for a tenant, of the layers `targets` selects (the SDK's flags,
        or the module names a checkpoint adapts); ConfigurationError for what cannot be made."""
        session = self.session(session_id, principal)
        self.check_base(base_model)
        _checked(adapter)
        if not 1 <= rank <= self.config.trainer_max_rank:
            raise ConfigurationError(
                f"rank={rank} is outside 1..{self.config.trainer_max_rank} "
                "(MINT_TRAINER_MAX_RANK); choose a rank in that range"
            )
        modules = targets.select(self.layers) if isinstance(targets, Targets) else targets
        held = sum(m.session.principal == principal for m in self.models.values())
        if held >= self.config.trainer_models:
            raise ConfigurationError(
                f"principal {principal!r} already holds {held} training models, the most "
                f"allowed (MINT_TRAINER_MODELS); finish a session to free one"
            )
        model_id = f"{session_id}:train:{model_seq_id}"
        shapes = {name: self.layers.shapes[name] for name in modules}
        lora = TenantLora(shapes, rank, seed, self.base.device)
        model = TrainingModel(
            model_id,
            session,
            base_model,
            lora,
            modules,
            torch.optim.AdamW(lora.parameters(), lr=AdamParams.learning_rate),
            adapter or session.adapter or _adapter_name(model_id),
        )
        with self._work:
            self.models[model_id] = model
        return model

    def check_base(self, name: str) -> None:
        text = self.base.text
        if name not in (text.model_id, text.name_or_path) and not names_folder(name, text.path):
            raise ConfigurationError(
                f"base_model {name!r} is not the base this trainer holds ({text.name_or_path}); "
                "use that name"
            )

    def _drop_model(self, model_id: str, why: str) -> None:
        model = self.models.pop(model_id)
        for op in model.queue.drain():
            self.futures.fail(op.request_id, f"{model_id} is gone: {why}")

    # Queueing work.

    def submit(self, model: TrainingModel, op: Op) -> None:
        with self._work:
            if len(model.queue) >= self.config.trainer_queue:
                raise QueueFull(
                    f"{model.id} has {len(model.queue)} requests waiting, the most allowed "
                    "(MINT_TRAINER_QUEUE); send it again once some are done"
                )
            model.queue.add(op)
            model.last_request = time.monotonic()
            self._work.notify()

    def stop(self) -> None:
        with self._work:
            self._stopped = True
            self._work.notify()
        self._thread.join(timeout=30)
        self._shipping.shutdown(wait=True)
        self.samplers.close()
        self.backend.close()

    def _expire_sessions(self) -> None:
        now = time.monotonic()
        for session in self.sessions.values():
            if session.finished is None and now - session.last_seen > SESSION_TIMEOUT_S:
                log.info(
                    "session %s expired (no heartbeat for %.0f s)",
                    session.id,
                    now - session.last_seen,
                )
                session.finished = "expired"
                for model_id in [m for m, model in self.models.items() if model.session is session]:
                    self._drop_model(model_id, f"its session {session.id} expired")

    def _loop(self) -> None:
        # A round: every model's forward/backward requests at the head of its queue go through
        # the base together; then every model's next other request (an optimizer step, most
        # often the one sent right behind those) runs, so that the next round's pass finds
        # every tenant that keeps up ready at once.
        while True:
            with self._work:
                while not self._stopped and not self._ready():
                    self._work.wait(timeout=1.0)  # a gap in a model's seq_ids times out
                    self._expire_sessions()
                if self._stopped:
                    return
                deadline = time.monotonic() + GATHER_S
                while self._stragglers() and (left := deadline - time.monotonic()) > 0:
                    self._work.wait(left)
                forward = self._take(forward=True)
            if forward:
                self._forward(forward)
            with self._work:
                single = self._take(forward=False)
            for model, op in single:
                self._run_single(model, op)

    def _stragglers(self) -> bool:
        """Whether a model that is training has no request ready to run."""
        now = time.monotonic()
        ready = self._ready()
        return any(
            model_id not in ready and now - model.last_request < ACTIVE_S
            for model_id, model in self.models.items()
        )

    def _ready(self) -> dict[str, list[Op]]:
        return {
            model_id: ops for model_id, model in self.models.items() if (ops := model.queue.ready())
        }

    def _take(self, forward: bool) -> list[tuple[TrainingModel, Op]]:
        """With `forward`, the forward/backward requests at the head of each model's queue (up
        to its first other request), within its principal's share of the round (`round_share`);
        else each model's head request if it is another kind."""
        runs: dict[str, tuple[str, list[Op]]] = {}
        for model_id, ops in self._ready().items():
            if forward:
                run = list(takewhile(lambda op: op.kind is OpKind.FORWARD, ops))
            else:
                run = ops[:1] if ops[0].kind is not OpKind.FORWARD else []
            runs[model_id] = (self.models[model_id].session.principal, run)
        if forward:
            shared = round_share(runs, self.tenancy.weight, self.config.trainer_batch_tokens)
        else:
            shared = {model_id: run for model_id, (_, run) in runs.items()}
        taken = []
        for model_id, run in shared.items():
            model = self.models[model_id]
            model.queue.take(run)
            taken.extend((model, op) for op in run)
        return taken

    def _forward(self, ops: list[tuple[TrainingModel, Op]]) -> None:
        works: list[tuple[Work, str]] = []
        for model, op in ops:
            request = op.payload
            assert isinstance(request, ForwardBackward)
            # Every value is checked before it joins a pass: a pass fails for no one's data.
            try:
                check_request(request, self.vocab, self.base.context_length)
            except Exception as e:
                self.futures.finish(op.request_id, failure(e, f"checking request {op.request_id}"))
                continue
            works.append((Work(request, model.lora), op.request_id))
        if not works:
            return
        try:
            for rows in plan_passes([w for w, _ in works], self.config.trainer_batch_tokens):
                with self.engine.lock:
                    run_pass(
                        self.base.model,
                        self.router,
                        rows,
                        self.base.codec.pad_id,
                        self.base.device,
                        before=self.engine.batch.reset,  # no serving slots in a training pass
                    )
        except Exception as e:  # a failed pass fails its requests, not the loop
            failed = failure(e, "the forward/backward pass", Category.SERVER)
            for _, request_id in works:
                self.futures.finish(request_id, failed)
            return
        for work, request_id in works:
            outputs = [out or {} for out in work.outputs]
            self.futures.finish(
                request_id, forward_backward_output(outputs, {"loss:sum": work.loss})
            )

    def _run_single(self, model: TrainingModel, op: Op) -> None:
        handlers: dict[OpKind, Callable[[TrainingModel, object], dict[str, object] | None]] = {
            OpKind.OPTIM: self._optim_step,
            OpKind.SAVE_STATE: self._save_state,
            OpKind.LOAD_STATE: self._load_state,
            OpKind.SAVE_SAMPLER: lambda m, p: self._save_for_sampler(m, p, op.request_id),
        }
        try:
            result = handlers[op.kind](model, op.payload)
        except Exception as e:  # one request's failure, not the loop's
            self.futures.finish(op.request_id, failure(e, f"{op.kind} of {model.id}"))
        else:
            if result is not None:
                self.futures.finish(op.request_id, result)

    # The single requests.

    def _optim_step(self, model: TrainingModel, payload: object) -> dict[str, object]:
        params = payload
        assert isinstance(params, AdamParams)
        if not (params.learning_rate >= 0 and 0 <= params.beta1 < 1 and 0 <= params.beta2 < 1):
            raise ConfigurationError(
                f"adam_params learning_rate={params.learning_rate}, beta1={params.beta1}, "
                f"beta2={params.beta2}: need learning_rate >= 0 and betas in [0, 1)"
            )
        trainable = list(model.lora.parameters())
        # The global norm before clipping (clip_grad_norm_ returns it); inf: no clipping.
        limit = params.grad_clip_norm if params.grad_clip_norm > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(trainable, limit))
        for group in model.optimizer.param_groups:
            group.update(
                lr=params.learning_rate,
                betas=(params.beta1, params.beta2),
                eps=params.eps,
                weight_decay=params.weight_decay,
            )
        with self.engine.lock:  # the parameters change: not under a pass of another thread
            model.optimizer.step()
        model.optimizer.zero_grad(set_to_none=True)
        model.steps += 1
        model.learning_rate = params.learning_rate
        return {"metrics": {"grad_norm:mean": norm, "learning_rate:mean": params.learning_rate}}

    def _save_state(self, model: TrainingModel, payload: object) -> dict[str, object]:
        name = checkpoints.check_name(str(payload))
        path = CheckpointPath(model.id, WEIGHTS, name)
        adapter_config, tensors = model.lora.peft_state(self.base.name_or_path)
        checkpoints.save_state(
            self.store,
            path,
            checkpoints.State(
                adapter_config,
                tensors,
                model.optimizer.state_dict(),
                self.base.digest,
                model.steps,
                model.targets,
                model.session.principal,
            ),
        )
        return {"path": str(path), "type": "save_weights"}

    def _load_state(self, model: TrainingModel, payload: object) -> dict[str, object]:
        path, with_optimizer = payload  # type: ignore[misc]
        state = self.read_state(path, model.session.principal)
        if state.targets != model.targets or state.adapter_config.get("r") != model.lora.rank:
            raise ConfigurationError(
                f"{path} holds a rank-{state.adapter_config.get('r')} LoRA of other layers than "
                f"{model.id} (rank {model.lora.rank}); load it with "
                "create_training_client_from_state instead"
            )
        self._restore(model, state, with_optimizer)
        return {"path": str(path), "model_id": model.id, "type": "load_weights"}

    def read_state(self, path: CheckpointPath, principal: str) -> checkpoints.State:
        """The state saved at `path`, for `principal` to load: AccessDeniedError unless it saved
        it or is an admin (checked before anything else about the state is said)."""
        if path.kind != WEIGHTS:
            raise ConfigurationError(
                f"{path} is sampler weights; training state is loaded from a save_state path "
                "(tinker://<model id>/weights/<name>)"
            )
        state = checkpoints.load_state(self.store, path)
        checkpoints.check_loader(
            state, path, principal, self.config.admin_principals, bool(self.config.api_keys)
        )
        if state.base_digest != self.base.digest:
            raise ConfigurationError(
                f"{path} was trained on another base ({state.base_digest}), not this trainer's "
                f"{self.base.model_id} ({self.base.digest})"
            )
        return state

    def create_from_state(
        self,
        session_id: str,
        model_seq_id: int,
        principal: str,
        path: CheckpointPath,
        with_optimizer: bool,
        base_model: str | None,
        adapter: str | None = None,
    ) -> TrainingModel:
        """A new model holding the state saved at `path` (`create_training_client_from_state`);
        its revisions go to `adapter` (the request's `user_metadata`) if given."""
        state = self.read_state(path, principal)
        model = self.create_model(
            session_id,
            model_seq_id,
            principal,
            base_model or self.base.name_or_path,
            int(state.adapter_config["r"]),  # type: ignore[call-overload]
            state.targets,
            None,
            adapter,
        )
        self._restore(model, state, with_optimizer)
        return model

    def _restore(
        self, model: TrainingModel, state: checkpoints.State, with_optimizer: bool
    ) -> None:
        model.lora.load_peft(state.tensors)
        model.optimizer.zero_grad(set_to_none=True)
        if with_optimizer and state.optimizer is not None:
            model.optimizer.load_state_dict(state.optimizer)
        model.steps = state.steps

    def _save_for_sampler(
        self, model: TrainingModel, payload: object, request_id: str
    ) -> dict[str, object] | None:
        save = payload
        assert isinstance(save, SamplerSave)
        adapter_config, tensors = model.lora.peft_state(self.base.name_or_path)
        if save.name is None:
            sampler = self.samplers.ephemeral(model, save.sampling_seq, adapter_config, tensors)
            return {"sampling_session_id": sampler, "type": "save_weights_for_sampler"}
        path = CheckpointPath(model.id, SAMPLER_WEIGHTS, checkpoints.check_name(save.name))
        snapshot = checkpoints.Snapshot(
            _checked(save.adapter) or model.adapter,
            adapter_config,
            tensors,
            model.lora.target_modules(),
            model.lora.rank,
            ALPHA,
            model.steps,
            model.learning_rate or AdamParams.learning_rate,
            model.session.id,
            model.session.principal,
        )

        def ship() -> None:
            try:
                revision = checkpoints.ship_snapshot(self.config, self.base.text, snapshot)
                checkpoints.record_sampler(self.store, path, revision)
                self.samplers.registered(
                    path, revision, adapter_config, tensors, (snapshot.principal,)
                )
            except Exception as e:
                failed = failure(e, f"registering {path}", Category.SERVER)
                self.futures.finish(request_id, failed)
            else:
                log.info("%s registered as %s", path, revision)
                self.futures.finish(
                    request_id, {"path": str(path), "type": "save_weights_for_sampler"}
                )

        # Registering takes a while (MLflow): it runs beside the model's next requests, which
        # train on while the snapshot ships.
        self._shipping.submit(ship)
        return None


def _checked(adapter: str | None) -> str | None:
    """A `mint_adapter` a request names, refused here (its request fails) rather than when its
    revision is registered."""
    return None if adapter is None else check_adapter_name(adapter)


def _adapter_name(model_id: str) -> str:
    """The MinT adapter a model's sampler weights become revisions of, by default."""
    session, _, seq = model_id.partition(":train:")
    return f"tinker-{session.removeprefix('s-')}-{seq}"


def names_folder(name: str, folder: Path) -> bool:
    """Whether `name` is a path to `folder`, however written: a cookbook script resolves its
    model path, which may go through a link to the folder the trainer loaded."""
    return Path(name).expanduser().resolve() == folder.resolve()
