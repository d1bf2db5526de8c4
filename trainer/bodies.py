"""The JSON request bodies of the Tinker API, as the `tinker` SDK (0.38) sends them: one
pydantic model per route, so that FastAPI refuses a body that is not one (a list where an
object belongs, a string seed, `Infinity` or `1e400` for an integer) with a 422 naming the
field, before any work, and the OpenAPI document describes what each route takes.

Strict: numbers and flags are what JSON says they are (no `"3"` for 3, no `1.0` for an
integer, no infinities); identifiers, lists and numbers are bounded, so that no value the
trainer echoes or loops over is of unbounded size. Fields the SDK sends that the trainer does
not read (`type`, `tags`, `ttl_seconds`, ...) are allowed and ignored: a newer SDK's additions
must not fail the wire.
"""

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from trainer.sampling import MAX_SAMPLES

MAX_ID = 256
"""Longest identifier (session, model, sampler, request id, checkpoint path) a body may
carry: ids the trainer makes are far shorter."""
MAX_NAME = 512
"""Longest other string (a base model's name or path, a loss or optimizer type)."""
MAX_PROMPT_TOKENS = 1 << 16
"""Most prompt tokens a sampling request may carry: beyond any base's context (the exact
context bound is checked before sampling)."""
MAX_CHUNKS = 1024
MAX_STOP = 64
MAX_INT = (1 << 63) - 1
"""Integers are int64 on the wire (and in SQLite, torch seeds): larger ones are refused here."""

Id = Annotated[str, StringConstraints(max_length=MAX_ID)]
Name = Annotated[str, StringConstraints(max_length=MAX_NAME)]
Count = Annotated[int, Field(ge=0, le=MAX_INT)]
Seed = Annotated[int, Field(ge=-(1 << 62), le=1 << 62)]
"""A random seed: any int64 torch takes, with room for the per-sample offsets added to it."""
Metadata = dict[str, Any]
"""`user_metadata`: the trainer reads its `mint_adapter` (an adapter name, checked where it is
used); the rest is the client's."""


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class CreateSession(Body):
    user_metadata: Metadata | None = None
    tags: list[Name] = Field(default_factory=list, max_length=MAX_CHUNKS)
    sdk_version: Name | None = None


class SessionHeartbeat(Body):
    session_id: Id


class Reason(Body):
    type: Name = ""


class FinishSession(Body):
    reason: Reason | None = None


class LoraConfig(Body):
    rank: int = Field(32, ge=1, le=1 << 16)
    seed: Seed | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(Body):
    type: Name = "adamw"


class CreateModel(Body):
    session_id: Id
    model_seq_id: Count
    base_model: Name
    user_metadata: Metadata | None = None
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig | None = None


class ModelRequest(Body):
    """A request about a training model, queued in its `seq_id` order."""

    model_id: Id
    seq_id: Count | None = None


class GetInfo(Body):
    model_id: Id


class AdamParams(Body):
    type: Name | None = None
    learning_rate: float = Field(1e-4, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-12, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip_norm: float = Field(0.0, ge=0)


class OptimStep(ModelRequest):
    """The SDK sends `adam_params` (older ones `optim_params` or `optimizer_params`)."""

    adam_params: AdamParams | None = None
    optim_params: AdamParams | None = None
    optimizer_params: AdamParams | None = None

    @property
    def params(self) -> AdamParams:
        return self.adam_params or self.optim_params or self.optimizer_params or AdamParams()


class SaveWeights(ModelRequest):
    path: Id | None = None


class LoadWeights(Body):
    """Into a live model (`model_id`), or creating one (`session_id` and `model_seq_id`)."""

    model_id: Id | None = None
    seq_id: Count | None = None
    session_id: Id | None = None
    model_seq_id: Count | None = None
    base_model: Name | None = None
    user_metadata: Metadata | None = None
    path: Id
    optimizer: bool = False


class SaveWeightsForSampler(ModelRequest):
    path: Id | None = None
    sampling_session_seq_id: Count | None = None
    user_metadata: Metadata | None = None


class CreateSamplingSession(Body):
    session_id: Id
    sampling_session_seq_id: Count
    base_model: Name | None = None
    model_path: Id | None = None


class Chunk(Body):
    type: Name = "encoded_text"
    tokens: list[Count] = Field(default_factory=list, max_length=MAX_PROMPT_TOKENS)


class ModelInput(Body):
    chunks: list[Chunk] = Field(max_length=MAX_CHUNKS)


class SamplingParams(Body):
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    temperature: float = Field(1.0, ge=0)
    top_k: int = Field(-1, ge=-1, le=MAX_INT)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: Seed | None = None
    stop: (
        Name
        | Annotated[list[Name], Field(max_length=MAX_STOP)]
        | Annotated[list[Count], Field(max_length=MAX_STOP)]
        | None
    ) = None


class Sample(Body):
    sampling_session_id: Id
    seq_id: Count | None = None
    num_samples: int = Field(1, ge=1, le=MAX_SAMPLES)
    prompt: ModelInput
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: Count = 0
    topk_sample_logprobs: Count = 0
    prompt_alt_tokens_k: Count = 0
    target_prompt_logprobs: Metadata | None = None
    prompt_logprobs_last_n: Count | None = None


class RetrieveFuture(Body):
    request_id: Id


class Telemetry(Body):
    """Whatever the SDK reports; not kept."""


def mint_adapter(metadata: Metadata | None) -> str | None:
    """The MinT adapter a request's `user_metadata` names (`{"mint_adapter": name}`), if any."""
    name = (metadata or {}).get("mint_adapter")
    return None if name is None else str(name)[: MAX_NAME + 1]
