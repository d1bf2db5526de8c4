"""LoRA training with PEFT on the resident base: the `train` step of the release pipeline.

Training never touches the resident base in place: PEFT wraps a private copy, and only the
adapter (a PEFT adapter directory) leaves this module.
"""

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from mint_core.base_model import ALL_PROJECTIONS, BaseModel
from mint_core.datasets import Task, dataset_digest, held_out_words, prompt_for, training_stream
from mint_core.errors import ConfigurationError
from mint_core.textgen import batch_examples, greedy_generate, seeded
from mint_core.tokenizer import CharTokenizer


@dataclass(frozen=True)
class TrainingConfig:
    """How one adapter is trained."""

    steps: int = 400
    """Optimizer steps. The default recipe (400 steps at 5e-3) clears the release tests' 0.8
    floor with margin on every seed and thread count measured (`bench/recipe.py`); 200 steps
    at 3e-3 scored from 0.58 to 0.98 on `reverse` depending on seed and CPU kernels."""
    rank: int = 8
    """LoRA rank r."""
    alpha: int = 16
    """LoRA alpha; the update is scaled by alpha / rank."""
    learning_rate: float = 5e-3
    """Peak AdamW learning rate (one-cycle schedule)."""
    batch_size: int = 32
    """Examples per step."""
    seed: int = 0
    """Seeds LoRA initialisation and the data stream."""
    target_modules: tuple[str, ...] = ALL_PROJECTIONS
    """Projections that get a LoRA pair."""

    def __post_init__(self) -> None:
        for name in ("steps", "rank", "batch_size"):
            if getattr(self, name) <= 0:
                raise ConfigurationError(f"training {name}={getattr(self, name)} must be > 0")
        unknown = sorted(set(self.target_modules) - set(ALL_PROJECTIONS))
        if unknown:
            raise ConfigurationError(
                f"unknown target modules {unknown}; choose from {list(ALL_PROJECTIONS)}"
            )


@dataclass(frozen=True)
class TrainedAdapter:
    """A PEFT adapter directory and what is known about how it was made."""

    path: Path
    task: Task
    config: TrainingConfig
    base_model_id: str
    base_digest: str
    dataset_digest: str
    eval_accuracy: float
    """Exact-match greedy accuracy on the held-out words."""

    def policy_fields(self) -> dict[str, object]:
        """What the policy record says about where this revision came from."""
        return {
            "base_model_id": self.base_model_id,
            "base_digest": self.base_digest,
            "task": self.task.value,
            "training_steps": self.config.steps,
            "dataset_digest": self.dataset_digest,
            "lora_rank": self.config.rank,
            "lora_alpha": self.config.alpha,
            "target_modules": self.config.target_modules,
            "eval_metrics": {"held_out_accuracy": self.eval_accuracy},
        }


def evaluate(model: torch.nn.Module, task: Task, words: list[str] | None = None) -> float:
    """Share of held-out words whose greedy answer is exactly the task's answer."""
    words = words or held_out_words()
    tokenizer = CharTokenizer()
    generations = greedy_generate(model, tokenizer, [prompt_for(w) for w in words], 16)
    hits = sum(
        g.text == task.answer(w) and g.finished for g, w in zip(generations, words, strict=True)
    )
    return hits / len(words)


def train_lora(
    base: BaseModel, task: Task, out_dir: Path, config: TrainingConfig
) -> TrainedAdapter:
    """Train one LoRA adapter for `task` on a copy of `base`, save it in PEFT layout."""
    lora = LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=0.0,
        target_modules=list(config.target_modules),
        task_type="CAUSAL_LM",
    )
    with seeded(config.seed):
        model = get_peft_model(copy.deepcopy(base.model), lora)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=config.learning_rate, total_steps=config.steps
    )
    tokenizer = CharTokenizer()
    stream = training_stream(task, config.seed)
    for _ in range(config.steps):
        batch = batch_examples([next(stream) for _ in range(config.batch_size)], tokenizer)
        model(**batch).loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    accuracy = evaluate(model, task)
    _save(model, out_dir, base.model_id)
    return TrainedAdapter(
        path=out_dir,
        task=task,
        config=config,
        base_model_id=base.model_id,
        base_digest=base.digest,
        dataset_digest=dataset_digest(task, config.seed),
        eval_accuracy=accuracy,
    )


def _save(model: PeftModel, out_dir: Path, base_model_id: str) -> None:
    model.peft_config["default"].base_model_name_or_path = base_model_id
    out_dir.mkdir(parents=True, exist_ok=True)
    # Embedding layers are not adapted; saying so stops PEFT from looking the base up on a hub.
    model.save_pretrained(out_dir, save_embedding_layers=False)
