"""The RL flow's steps as Prefect tasks: start a GRPO trainer, take a step on completions a
worker sampled, and turn the trainer's LoRA into something the release pipeline ships.

The trainer (a PeftModel) lives in the flow's process across steps, so none of these tasks
caches or persists its result.
"""

import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from mint_core.artifacts.digests import sha256_bytes
from mint_core.artifacts.packing import unpack
from mint_core.artifacts.stores import open_store
from mint_core.config import MintConfig
from mint_core.errors import BaseMismatchError, IntegrityError
from mint_core.model.base import load_base
from mint_core.model.rl import (
    Group,
    GrpoConfig,
    GrpoTrainer,
    Sample,
    Sampler,
    StepMetrics,
    answer_budget,
)
from mint_core.model.text import TextCodec
from mint_core.model.toy import Example
from mint_core.model.training import TrainedAdapter, TrainingConfig
from mint_core.registry import DatasetLog, RegisteredRevision, Registry
from serving.http.client import WorkerClient


class WorkerSampler:
    """A `Sampler` over a worker's `/generate`: `n` completions of a prompt by `adapter_id`
    (`name@rl`) at temperature 1, with log-probabilities and routes; each names the revision
    that sampled it. Sample i of the k-th call is seeded `seed + k * n + i`, so a run samples
    the same tokens again from the same revisions."""

    def __init__(
        self,
        client: WorkerClient,
        adapter_id: str | None,
        codec: TextCodec,
        routes: bool,
        seed: int,
    ) -> None:
        self.client = client
        self.adapter_id = adapter_id
        self.codec = codec
        self.routes = routes
        self._seed = seed

    def sample(self, prompt: str, n: int, max_new_tokens: int) -> list[Sample]:
        prompt_ids = tuple(self.codec.encode(prompt))
        sampled = self.client.sample(
            prompt, self.adapter_id, n, max_new_tokens, 1.0, self._seed, self.routes
        )
        self._seed += n
        samples = []
        for s in sampled:
            routes = None
            if s.routes is not None and s.prompt_routes is not None:
                # The worker tokenized the prompt itself: its routes must cover ours.
                if len(s.prompt_routes) != len(prompt_ids) - 1:
                    raise IntegrityError(
                        f"{s.revision} routed {len(s.prompt_routes) + 1} prompt positions of "
                        f"{prompt!r}, the trainer's tokenizer gives {len(prompt_ids)}; serve "
                        "and train on the same base folder"
                    )
                routes = torch.tensor([*s.prompt_routes, *s.routes])
            samples.append(Sample(prompt_ids, s.token_ids, s.logprobs, routes, s.revision))
        return samples


@task(name="rl-start", cache_policy=NO_CACHE)
def start_trainer(
    config: MintConfig, grpo: GrpoConfig, start: RegisteredRevision | None
) -> GrpoTrainer:
    """A trainer ready for its first GRPO step: on a zero LoRA, or on the adapter of the
    registered revision `start` (fetched from the artifact store, checked and unpacked)."""
    base = load_base(config.base, config.home, training=True)
    if start is None:
        return GrpoTrainer(base, grpo)
    if start.policy.base_digest != base.digest:
        raise BaseMismatchError(
            f"{start.id} was trained on {start.policy.base_model_id}, not on the RL run's base "
            f"{base.model_id}; start from a revision of this base (or none)"
        )
    folder = open_store(config).fetch(start.artifact_uri)
    peft_dir = unpack(folder, config.work_root / "rl-start" / uuid.uuid4().hex[:12])
    return GrpoTrainer(base, grpo, peft_dir)


@dataclass(frozen=True)
class RlRun:
    """The MLflow run an RL run logs to, and the dataset name its revisions record."""

    run_id: str
    dataset: str
    """`rl:<task>`."""
    dataset_digest: str
    """A digest of what generates the prompts (task, longest word, seed)."""


@task(name="rl-run", cache_policy=NO_CACHE)
def start_rl_run(
    config: MintConfig, adapter: str, grpo: GrpoConfig, task_name: str, prompts: str, seed: int
) -> RlRun:
    """An MLflow run for the whole RL run: the hyperparameters as params, the prompt stream as
    its dataset; each step's metrics follow."""
    dataset = f"rl:{task_name}"
    digest = sha256_bytes(f"{dataset}|{prompts}|seed={seed}".encode())
    run_id = Registry(config.tracking_uri).runs.start_training(
        adapter,
        grpo.params() | {"rl_task": task_name, "prompts": prompts},
        DatasetLog(dataset, digest, 0),
        config.host_name,
    )
    return RlRun(run_id, dataset, digest)


@task(name="rl-step", cache_policy=NO_CACHE)
def rl_step(
    trainer: GrpoTrainer, sampler: Sampler, examples: Sequence[Example], group: int
) -> tuple[StepMetrics, tuple[str, ...]]:
    """Sample `group` completions of each example and take one GRPO step on them; the step's
    figures and the revisions that sampled it."""
    codec = trainer.base.codec
    groups = [
        Group(
            e.completion, tuple(sampler.sample(e.prompt, group, answer_budget(codec, e.completion)))
        )
        for e in examples
    ]
    revisions = sorted({s.revision or "" for g in groups for s in g.samples})
    return trainer.step(groups), tuple(revisions)


@task(name="rl-save", cache_policy=NO_CACHE)
def save_policy(
    config: MintConfig, adapter: str, trainer: GrpoTrainer, run: RlRun, metrics: dict[str, float]
) -> TrainedAdapter:
    """The trainer's LoRA as a PEFT folder, described as the release pipeline registers it:
    trained for `trainer.steps` steps on `rl:<task>`, with the last step's metrics."""
    out_dir = config.work_root / "train" / f"{adapter}-rl-{uuid.uuid4().hex[:12]}"
    trainer.save(out_dir)
    grpo = trainer.config
    return TrainedAdapter(
        path=out_dir,
        config=TrainingConfig(
            rank=trainer.lora.r,
            alpha=int(trainer.lora.lora_alpha),
            target_modules=trainer.target_modules,
            expert_targets=trainer.target_parameters,
            learning_rate=grpo.learning_rate,
            steps=max(trainer.steps, 1),
            seed=grpo.seed,
        ),
        target_modules=trainer.target_modules,
        target_parameters=trainer.target_parameters,
        base_model_id=trainer.base.model_id,
        base_digest=trainer.base.digest,
        dataset=run.dataset,
        dataset_digest=run.dataset_digest,
        steps=trainer.steps,
        losses=(),
        eval_metrics=metrics,
        run_id=run.run_id,
    )


def batches(stream: Iterator[Example], size: int) -> Iterator[list[Example]]:
    """`size` examples at a time from an endless stream."""
    while True:
        yield [next(stream) for _ in range(size)]
