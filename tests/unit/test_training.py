"""Training a LoRA on the user's JSONL data, on tiny untrained bases: chat rows train, and bad
hyperparameters, targets and rows are refused before the first step. That it is real (on the
embedded default, an adapter trained from a generated file learns a task the base cannot do)
is tests/integration/test_default_base.py."""

import json
import math
from pathlib import Path

import pytest
from transformers import Qwen3Config, Qwen3ForCausalLM

from mint_core.errors import ConfigurationError, DatasetError
from mint_core.model import toy
from mint_core.model.base import DEFAULT_TARGETS, BaseSource
from mint_core.model.datasets import Dataset, parse_jsonl
from mint_core.model.generate import seeded
from mint_core.model.tiny import SPECIAL_TOKENS, TinySpec, ensure_tiny, save_base_folder
from mint_core.model.training import TrainingConfig, train_lora

TINY = TinySpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, pretrain_steps=0)
RECIPE = TrainingConfig(**toy.RECIPE)  # type: ignore[arg-type]
"""The toy recipe: with 12,800 generated rows, one epoch is 400 steps."""


def read(path: Path) -> Dataset:
    return parse_jsonl(path.read_bytes(), str(path))


def write_rows(path: Path, rows: list[dict[str, object]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[BaseSource, Path]:
    """A tiny untrained base folder and the MINT_HOME it was built in."""
    home = tmp_path_factory.mktemp("home")
    return BaseSource(str(ensure_tiny(TINY, home / "base"))), home


@pytest.fixture(scope="module")
def upper_rows(tmp_path_factory: pytest.TempPathFactory) -> tuple[Dataset, Dataset]:
    folder = tmp_path_factory.mktemp("data")
    return (
        read(toy.write_task_data(toy.Task.UPPER, folder, rows=64)),
        read(toy.write_held_out_data(toy.Task.UPPER, folder, count=8)),
    )


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> tuple[BaseSource, Path]:
    """A tiny Qwen3 (q/k norms, grouped-query attention, untied embeddings) built from config
    with the byte tokenizer and its chat template. Initialised wider than Hugging Face's
    default so its logits can move within a few steps (an untrained tiny model at std 0.02
    is stuck near the uniform loss, whatever the adapter learns)."""
    home = tmp_path_factory.mktemp("home")
    config = Qwen3Config(
        vocab_size=len(SPECIAL_TOKENS) + 256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=128, tie_word_embeddings=False, initializer_range=0.2,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    with seeded(0):
        model = Qwen3ForCausalLM(config)
    save_base_folder(model, home / "qwen3-tiny")
    return BaseSource(str(home / "qwen3-tiny")), home


def test_chat_rows_train_and_report_every_step(
    qwen3: tuple[BaseSource, Path], tmp_path: Path
) -> None:
    words = ["apple", "pear", "plum", "fig", "kiwi", "lime", "date", "grape"]
    rows = [
        {"messages": [
            {"role": "system", "content": "Reverse the word."},
            {"role": "user", "content": word},
            {"role": "assistant", "content": word[::-1]},
        ]}
        for word in words
    ]  # fmt: skip
    data = read(write_rows(tmp_path / "chat.jsonl", rows))
    reported: list[tuple[int, int, float]] = []
    trained = train_lora(
        *qwen3, data, data, tmp_path / "adapter",
        TrainingConfig(steps=12, batch_size=8, learning_rate=2e-2),
        on_step=lambda step, total, loss: reported.append((step, total, loss)),
    )  # fmt: skip
    assert reported == [(step, 12, loss) for step, loss in enumerate(trained.losses, start=1)]
    assert all(math.isfinite(loss) for loss in trained.losses)
    assert trained.losses[-1] < trained.losses[0] / 2, trained.losses
    assert set(trained.eval_metrics) == {"eval_loss", "eval_exact_match"}
    assert trained.eval_metrics["eval_loss"] < trained.losses[0] / 2
    saved = json.loads((trained.path / "adapter_config.json").read_text())
    # The full path, which PEFT's loaders find; the model id is the folder's name only.
    assert trained.base_model_id == "qwen3-tiny"
    assert saved["base_model_name_or_path"] == qwen3[0].name == str(qwen3[1] / "qwen3-tiny")
    assert sorted(saved["target_modules"]) == sorted(trained.target_modules)
    assert sorted(trained.target_modules) == sorted(DEFAULT_TARGETS)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"rank": 0}, r"training rank=0 must be > 0"),
        ({"alpha": -16}, r"training alpha=-16 must be > 0"),
        ({"batch_size": 0}, r"training batch_size=0 must be > 0"),
        ({"gradient_accumulation": 0}, r"training gradient_accumulation=0 must be > 0"),
        ({"steps": 0}, r"training steps=0 must be > 0"),
        ({"max_length": -1}, r"training max_length=-1 must be > 0"),
        ({"epochs": 0.0}, r"epochs=0\.0"),
        ({"learning_rate": -1e-3}, r"learning_rate=-0\.001"),
        ({"learning_rate": math.nan}, r"learning_rate=nan"),
        ({"dropout": 1.0}, r"dropout=1\.0 in \[0, 1\)"),
        ({"dropout": math.nan}, r"dropout=nan"),
    ],
    ids=lambda value: str(value) if isinstance(value, dict) else "",
)
def test_bad_hyperparameters_are_refused_naming_the_value(
    values: dict[str, float], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        TrainingConfig(**values)  # type: ignore[arg-type]


def test_steps_follow_epochs_batch_size_and_accumulation() -> None:
    assert TrainingConfig(batch_size=8).total_steps(20) == 3
    assert TrainingConfig(batch_size=8, epochs=2).total_steps(20) == 6
    assert TrainingConfig(batch_size=4, gradient_accumulation=2, epochs=0.5).total_steps(20) == 2
    assert TrainingConfig(batch_size=8, steps=7).total_steps(20) == 7
    assert RECIPE.total_steps(12_800) == 400


@pytest.mark.parametrize(
    ("targets", "refused"),
    [
        (("q_proj", "lm_head"), r"\['lm_head'\]"),
        (("embed_tokens", "v_proj", "lm_head"), r"\['embed_tokens', 'lm_head'\]"),
        (("q_proj", "qkv_proj"), r"\['qkv_proj'\]"),
    ],
)
def test_targets_the_engine_cannot_serve_are_refused_before_training(
    tiny: tuple[BaseSource, Path],
    upper_rows: tuple[Dataset, Dataset],
    tmp_path: Path,
    targets: tuple[str, ...],
    refused: str,
) -> None:
    steps: list[int] = []
    with pytest.raises(
        ConfigurationError,
        match=rf"target modules {refused} are not linear layers MinT serves on the base "
        r"mint-tiny-llama-.*; choose from \['down_proj', 'gate_proj', 'k_proj', 'o_proj', "
        r"'q_proj', 'up_proj', 'v_proj'\]",
    ):
        train_lora(*tiny, *upper_rows, tmp_path / "adapter",
                   TrainingConfig(steps=2, target_modules=targets),
                   on_step=lambda step, *_: steps.append(step))  # fmt: skip
    assert steps == []
    assert not (tmp_path / "adapter").exists()


def test_rows_too_long_for_training_are_refused_before_the_first_step(
    tiny: tuple[BaseSource, Path], upper_rows: tuple[Dataset, Dataset], tmp_path: Path
) -> None:
    data, held_out = upper_rows
    short = {"prompt": "ab=", "completion": "AB"}
    long_file = write_rows(
        tmp_path / "long.jsonl", [short, short, {"prompt": "x" * 100 + "=", "completion": "y" * 40}]
    )
    steps: list[int] = []

    def attempt(data: Dataset, held_out: Dataset, config: TrainingConfig) -> None:
        train_lora(*tiny, data, held_out, tmp_path / "adapter", config,
                   on_step=lambda step, *_: steps.append(step))  # fmt: skip

    # BOS + 101 + 40 + EOS = 143 tokens; the tiny base's context is 128.
    with pytest.raises(
        DatasetError, match=rf"^{long_file}:3: the row is 143 tokens, longer than max_length 128"
    ):
        attempt(read(long_file), held_out, TrainingConfig(steps=2))
    # The held-out rows are checked before training too, against --max-length.
    with pytest.raises(
        DatasetError,
        match=rf"^{held_out.source}:1: the row is \d+ tokens, longer than max_length 8",
    ):
        attempt(read(write_rows(tmp_path / "short.jsonl", [short])), held_out,
                TrainingConfig(steps=2, max_length=8))  # fmt: skip
    with pytest.raises(
        ConfigurationError,
        match=r"max_length=4096 exceeds the base model's context of 128 tokens; lower "
        "--max-length",
    ):
        attempt(data, held_out, TrainingConfig(max_length=4096))
    assert steps == []
    assert not (tmp_path / "adapter").exists()
