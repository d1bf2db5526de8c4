"""The RL flow's steps as Prefect tasks: start a GRPO trainer, take a step on completions a
worker sampled, and turn the trainer's LoRA into something the release pipeline ships.

The trainer lives across steps, so none of these tasks caches or persists its result: a
PeftModel in the flow's process, or (`nproc_per_node` > 1) `LaunchedTrainer`, torchrun's ranks
on this host (`mint_core.model.rl_ranks`) driven from here, data parallel over each step's
prompts. One node only: the ranks wait between steps while the flow samples and ships.
"""

import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from peft import LoraConfig
from prefect import task
from prefect.cache_policies import NO_CACHE

from mint_core.artifacts.digests import sha256_bytes
from mint_core.artifacts.packing import unpack
from mint_core.artifacts.stores import open_store
from mint_core.config import MintConfig
from mint_core.distributed import Launch, World
from mint_core.errors import BaseMismatchError, IntegrityError
from mint_core.model.base import BaseModel, BaseSource, BaseText, load_base, load_text
from mint_core.model.rl import (
    Group,
    GrpoConfig,
    GrpoTrainer,
    Sample,
    Sampler,
    StepMetrics,
    answer_budget,
)
from mint_core.model.rl_ranks import ENTRY, Describe, RlJob, Save, Step, Stop
from mint_core.model.text import TextCodec
from mint_core.model.toy import Example
from mint_core.model.training import TrainedAdapter, TrainingConfig
from mint_core.registry import DatasetLog, RegisteredRevision, Registry
from processes.managed import LOOPBACK, free_port
from processes.torchrun import start_ranks
from serving.http.client import WorkerClient

RL_RANKS_TIMEOUT_S = 3600.0
"""torch.distributed's timeout on the rl ranks: ranks other than 0 wait in a broadcast for the
driver's next step while it samples and ships, which this must outlast. A lost rank is still
found at once: on one node torchrun ends every rank when one fails."""


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


class PolicyTrainer(Protocol):
    """What the rl flow drives: a `GrpoTrainer` here, or a `LaunchedTrainer`."""

    config: GrpoConfig
    steps: int
    world: World
    moe: bool

    @property
    def base(self) -> BaseModel | BaseText: ...
    @property
    def lora(self) -> LoraConfig: ...
    @property
    def target_modules(self) -> tuple[str, ...]: ...
    @property
    def target_parameters(self) -> tuple[str, ...]: ...
    def step(self, groups: Sequence[Group]) -> StepMetrics: ...
    def save(self, out_dir: Path) -> Path: ...


class LaunchedTrainer:
    """A GrpoTrainer on torchrun's ranks, one node, each step's groups sent to every rank and
    rank 0's answer returned. This process loads only the base's tokenizer and config
    (`load_text`: the sampler's codec, the policy record's base id and digest), never its
    weights."""

    def __init__(
        self,
        source: BaseSource,
        home: Path,
        grpo: GrpoConfig,
        start: Path | None,
        nproc_per_node: int,
        run_dir: Path,
    ) -> None:
        launch = Launch(nproc_per_node=nproc_per_node, timeout_s=RL_RANKS_TIMEOUT_S)
        self.base = load_text(source, home)
        self.config = grpo
        self.steps = 0
        job = (ENTRY, RlJob(source, home, grpo, start))
        self._ranks = start_ranks(launch, run_dir, (LOOPBACK, free_port()), job=job)
        try:
            described = self._ranks.call(Describe())
        except BaseException:
            self._ranks.stop()
            raise
        self.lora: LoraConfig = described.lora
        self.target_modules: tuple[str, ...] = described.target_modules
        self.target_parameters: tuple[str, ...] = described.target_parameters
        self.moe: bool = described.moe
        self.world: World = described.world

    def step(self, groups: Sequence[Group]) -> StepMetrics:
        metrics: StepMetrics = self._ranks.call(Step(tuple(groups)))  # type: ignore[assignment]
        self.steps = metrics.step
        return metrics

    def save(self, out_dir: Path) -> Path:
        return self._ranks.call(Save(out_dir))  # type: ignore[return-value]

    def stop(self, clean: bool = True) -> None:
        """End the ranks: `clean`, they are asked to and exit; else (or if that fails) they
        are ended by signal."""
        try:
            if clean and self._ranks.process.poll() is None:
                self._ranks.call(Stop())
                self._ranks.result()
        finally:
            self._ranks.stop()


@contextmanager
def stopping(trainer: PolicyTrainer) -> Iterator[PolicyTrainer]:
    """`trainer`, whose ranks (a LaunchedTrainer's) end with the block, however it ends."""
    if not isinstance(trainer, LaunchedTrainer):
        yield trainer
        return
    try:
        yield trainer
    except BaseException:
        trainer.stop(clean=False)
        raise
    trainer.stop()


@task(name="rl-start", cache_policy=NO_CACHE)
def start_trainer(
    config: MintConfig,
    grpo: GrpoConfig,
    start: RegisteredRevision | None,
    nproc_per_node: int = 1,
) -> PolicyTrainer:
    """A trainer ready for its first GRPO step: on a zero LoRA, or on the adapter of the
    registered revision `start` (fetched from the artifact store, checked and unpacked); in
    this process, or on `nproc_per_node` ranks on this host when that is more than one."""
    text = load_text(config.base, config.home)
    peft_dir = None
    if start is not None:
        if start.policy.base_digest != text.digest:
            raise BaseMismatchError(
                f"{start.id} was trained on {start.policy.base_model_id}, not on the RL run's "
                f"base {text.model_id}; start from a revision of this base (or none)"
            )
        folder = open_store(config).fetch(start.artifact_uri)
        peft_dir = unpack(folder, config.work_root / "rl-start" / uuid.uuid4().hex[:12])
    if nproc_per_node > 1:
        run_dir = config.work_root / "rl-ranks" / uuid.uuid4().hex[:12]
        return LaunchedTrainer(config.base, config.home, grpo, peft_dir, nproc_per_node, run_dir)
    base = load_base(config.base, config.home, training=True)
    return GrpoTrainer(base, grpo, peft_dir, World(hosts=(config.host_name,)))


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
    config: MintConfig,
    adapter: str,
    grpo: GrpoConfig,
    task_name: str,
    prompts: str,
    seed: int,
    world: World,
) -> RlRun:
    """An MLflow run for the whole RL run: the hyperparameters and the `world` the policy
    update runs on as params, the prompt stream as its dataset; each step's metrics follow."""
    dataset = f"rl:{task_name}"
    digest = sha256_bytes(f"{dataset}|{prompts}|seed={seed}".encode())
    trained_with = {name: str(value) for name, value in world.policy_fields().items()}
    runs = Registry(config.tracking_uri).runs
    run_id = runs.start_training(
        adapter,
        grpo.params() | trained_with | {"rl_task": task_name, "prompts": prompts},
        DatasetLog(dataset, digest, 0),
        config.host_name,
    )
    runs.set_tags(run_id, world.tags())  # as a release's training run is tagged
    return RlRun(run_id, dataset, digest)


@task(name="rl-step", cache_policy=NO_CACHE)
def rl_step(
    trainer: PolicyTrainer, sampler: Sampler, examples: Sequence[Example], group: int
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
    config: MintConfig,
    adapter: str,
    trainer: PolicyTrainer,
    run: RlRun,
    metrics: dict[str, float],
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
        world=trainer.world,
    )


def batches(stream: Iterator[Example], size: int) -> Iterator[list[Example]]:
    """`size` examples at a time from an endless stream."""
    while True:
        yield [next(stream) for _ in range(size)]
