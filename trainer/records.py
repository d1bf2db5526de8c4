"""What the trainer keeps for its tenants: sessions (one per SDK `ServiceClient`), training
models (a tenant's LoRA and its AdamW state) and the parameters of their requests."""

import time
from dataclasses import dataclass, field

import torch

from trainer.lora import TenantLora
from trainer.sequencing import Sequencer


@dataclass(frozen=True)
class AdamParams:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass(frozen=True)
class SamplerSave:
    """A `save_weights_for_sampler` request: `name` None for an ephemeral sampler."""

    name: str | None
    sampling_seq: int | None
    adapter: str | None
    """The adapter its revision goes to (the request's `user_metadata`), else the model's."""


@dataclass
class Session:
    id: str
    principal: str
    adapter: str | None = None
    """The MinT adapter its models' revisions go to (the `ServiceClient`'s `user_metadata`),
    where a model or a save names none of its own."""
    created: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.monotonic)
    finished: str | None = None


@dataclass
class TrainingModel:
    id: str
    session: Session
    base_model: str
    """The name the client gave the base (`create_model`'s `base_model`)."""
    lora: TenantLora
    targets: tuple[str, ...]
    optimizer: torch.optim.AdamW
    adapter: str
    """The MinT adapter its sampler weights become revisions of."""
    queue: Sequencer = field(default_factory=Sequencer)
    last_request: float = 0.0
    """When its client last sent a request (monotonic)."""
    steps: int = 0
    learning_rate: float = AdamParams.learning_rate
