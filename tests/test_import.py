"""`mint import`: PEFT adapters trained elsewhere (any rank and alpha, rsLoRA or not, any subset
of projections) are checked against the base, released through the pipeline from freeze on,
and served with exactly the answers PEFT's own PeftModel gives."""

import copy
from pathlib import Path

import pytest
from peft import LoraConfig, PeftModel

from mint_cli import main as mint
from mint_core.base_model import BaseModel, BaseModelSpec, load_base
from mint_core.config import MintConfig
from mint_core.datasets import held_out_words, prompt_for
from mint_core.errors import BaseMismatchError, ConfigurationError, NotFoundError
from mint_core.imports import inspect_import
from mint_core.registry import Registry
from mint_core.revisions import RevisionRef
from mint_core.textgen import greedy_generate
from mint_core.tokenizer import CharTokenizer
from serving.client import WorkerClient
from tests.helpers import random_lora

pytestmark = pytest.mark.slow

PROMPTS = [prompt_for(word) for word in held_out_words()[:16]]


def made_elsewhere(base: BaseModel, folder: Path, lora: LoraConfig, seed: int) -> Path:
    """A PEFT adapter as another team's training would save it: random (non-zero) LoRA weights
    standing in for whatever they learned, saved with PeftModel.save_pretrained."""
    random_lora(base.model, lora, seed, std=0.3).save_pretrained(
        folder, save_embedding_layers=False
    )
    return folder


@pytest.mark.parametrize(
    ("name", "lora"),
    [
        ("rslora-bot", LoraConfig(r=4, lora_alpha=7, use_rslora=True,
                                  target_modules=["q_proj", "v_proj", "down_proj"])),
        ("pattern-bot", LoraConfig(r=2, lora_alpha=16, rank_pattern={"o_proj": 5},
                                   alpha_pattern={"up_proj": 3},
                                   target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"])),
    ],
)  # fmt: skip
def test_imported_adapter_serves_exactly_what_peft_gives(
    name: str, lora: LoraConfig, base: BaseModel, fleet_config: MintConfig, tmp_path: Path
) -> None:
    folder = made_elsewhere(base, tmp_path / name, lora, seed=len(name))
    reference = PeftModel.from_pretrained(copy.deepcopy(base.model), folder).eval()
    expected = [g.text for g in greedy_generate(reference, CharTokenizer(), PROMPTS, 20)]
    assert expected != [g.text for g in greedy_generate(base.model, CharTokenizer(), PROMPTS, 20)]

    assert mint(["import", str(folder), "--adapter", name, "--actor", "partner-team"]) == 0

    client = WorkerClient(fleet_config.worker_urls[0])
    served = [client.generate(prompt, name) for prompt in PROMPTS]
    assert [text for text, _ in served] == expected
    assert {revision for _, revision in served} == {f"{name}:r1"}
    policy = Registry(fleet_config.tracking_uri).resolve(RevisionRef(name)).policy
    assert (policy.task, policy.lora_rank, policy.lora_alpha, policy.created_by) == (
        "imported", lora.r, lora.lora_alpha, "partner-team")  # fmt: skip


def test_adapter_for_another_base_is_refused_before_anything_is_registered(
    base: BaseModel, fleet_config: MintConfig, tmp_path: Path
) -> None:
    other = load_base(
        BaseModelSpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                      pretrain_steps=0), tmp_path / "other-home")  # fmt: skip
    lora = LoraConfig(r=2, target_modules=["q_proj"])
    folder = made_elsewhere(other, tmp_path / "alien", lora, seed=1)
    with pytest.raises(BaseMismatchError, match=r"q_proj.lora_A.weight' has shape \[2, 32\]"):
        inspect_import(folder, base)
    assert mint(["import", str(folder), "--adapter", "alien-bot"]) == 1
    with pytest.raises(NotFoundError):
        Registry(fleet_config.tracking_uri).revisions("alien-bot")


def test_unsupported_adapters_are_refused_naming_the_problem(
    base: BaseModel, tmp_path: Path
) -> None:
    dora = made_elsewhere(
        base, tmp_path / "dora", LoraConfig(r=2, use_dora=True, target_modules=["q_proj"]), 1
    )
    with pytest.raises(ConfigurationError, match="use_dora=True is not supported"):
        inspect_import(dora, base)
    with pytest.raises(ConfigurationError, match="not a PEFT adapter directory"):
        inspect_import(tmp_path, base)
