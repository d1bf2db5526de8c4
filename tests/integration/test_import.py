"""`mint import`: PEFT adapters trained elsewhere (any rank and alpha, rsLoRA or not, any subset
of projections) are checked against the base, released through the pipeline from freeze on,
and served with exactly the answers PEFT's own PeftModel gives."""

import copy
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from mint_cli import main as mint
from mint_core.artifacts.freezing import PEFT_CONFIG, PEFT_WEIGHTS
from mint_core.config import MintConfig
from mint_core.errors import BaseMismatchError, ConfigurationError, NotFoundError
from mint_core.model.base import BaseModel, BaseSource, load_base
from mint_core.model.generate import greedy_generate
from mint_core.model.imports import inspect_import
from mint_core.model.tiny import SPECIAL_TOKENS, TinySpec
from mint_core.model.toy import held_out_words, prompt_for
from mint_core.registry import Registry
from mint_core.revisions import POLICY_FILE, RevisionRef
from serving.http.client import WorkerClient
from tests.helpers import family_folder, make_policy, random_lora, tiny_base

PROMPTS = [prompt_for(word) for word in held_out_words()[:16]]


def made_elsewhere(model: torch.nn.Module, folder: Path, lora: LoraConfig, seed: int) -> Path:
    """A PEFT adapter as another team's training would save it: random (non-zero) LoRA weights
    standing in for whatever they learned, saved with PeftModel.save_pretrained."""
    random_lora(model, lora, seed, std=0.3).save_pretrained(folder, save_embedding_layers=False)
    return folder


@pytest.mark.slow
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
    folder = made_elsewhere(base.model, tmp_path / name, lora, seed=len(name))
    reference = PeftModel.from_pretrained(copy.deepcopy(base.model), folder).eval()
    prompt_ids = [base.codec.encode(prompt) for prompt in PROMPTS]
    expected = [g.text for g in greedy_generate(reference, base.codec, prompt_ids, 20)]
    assert expected != [g.text for g in greedy_generate(base.model, base.codec, prompt_ids, 20)]

    assert mint(["import", str(folder), "--adapter", name, "--actor", "partner-team"]) == 0

    client = WorkerClient(fleet_config.worker_urls[0])
    served = [client.generate(prompt, name) for prompt in PROMPTS]
    assert [text for text, _ in served] == expected
    assert {revision for _, revision in served} == {f"{name}:r1"}
    policy = Registry(fleet_config.tracking_uri).revisions.resolve(RevisionRef(name)).policy
    assert (policy.dataset, policy.training_steps, policy.lora_rank, policy.lora_alpha,
            policy.created_by) == ("", 0, lora.r, lora.lora_alpha, "partner-team")  # fmt: skip


def qwen3_adapter(folder: Path, base: BaseModel) -> Path:
    """A LoRA made on another family and size: a tiny Qwen3 (grouped-query attention, q/k
    norms, untied embeddings) 64 wide."""
    config = Qwen3Config(
        vocab_size=len(SPECIAL_TOKENS) + 256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        tie_word_embeddings=False,
    )  # fmt: skip
    lora = LoraConfig(r=2, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    return made_elsewhere(Qwen3ForCausalLM(config), folder, lora, seed=1)


def narrow_llama_adapter(folder: Path, base: BaseModel) -> Path:
    """A LoRA made on the serving base's family but another width (32)."""
    other = tiny_base(TinySpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                               pretrain_steps=0), folder.parent / "other-home")  # fmt: skip
    return made_elsewhere(other.model, folder, LoraConfig(r=2, target_modules=["q_proj"]), 1)


def q_norm_adapter(folder: Path, base: BaseModel) -> Path:
    """A LoRA on Qwen3's q_norm, as a trainer other than PEFT (which cannot adapt a norm)
    might write one."""
    module = "base_model.model.model.layers.0.self_attn.q_norm"
    folder.mkdir(parents=True)
    tensors = {f"{module}.lora_A.weight": torch.randn(2, 32),
               f"{module}.lora_B.weight": torch.randn(32, 2)}  # fmt: skip
    save_file(tensors, folder / PEFT_WEIGHTS, metadata={"format": "pt"})
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_norm"]}
    (folder / PEFT_CONFIG).write_text(json.dumps(config))
    return folder


def lm_head_adapter(folder: Path, base: BaseModel) -> Path:
    lora = LoraConfig(r=2, target_modules=["q_proj", "lm_head"])
    return made_elsewhere(base.model, folder, lora, seed=1)


def embedding_adapter(folder: Path, base: BaseModel) -> Path:
    return made_elsewhere(base.model, folder, LoraConfig(r=2, target_modules=["embed_tokens"]), 1)


NOT_FOR_THIS_BASE: dict[str, tuple[Callable[[Path, BaseModel], Path], str]] = {
    "qwen3": (qwen3_adapter,
              r"'base_model\.model\.model\.layers\.0\.self_attn\.k_proj\.lora_A\.weight' has "
              r"shape \[2, 64\], but model\.layers\.0\.self_attn\.k_proj of the base "
              r"mint-tiny-llama-\w+ is \d+x\d+ \(out x in\); this adapter was made for another "
              "model"),
    "narrow-llama": (narrow_llama_adapter, r"q_proj\.lora_A\.weight' has shape \[2, 32\]"),
    "q_norm": (q_norm_adapter,
               r"adapts 'model\.layers\.0\.self_attn\.q_norm', which is not a linear layer MinT "
               r"can serve on the base mint-tiny-llama-\w+ \(llama; embeddings and lm_head are "
               r"not adaptable\)"),
    "lm_head": (lm_head_adapter, r"'base_model\.model\.lm_head\.[\w.]+'"),
    "embed_tokens": (embedding_adapter, r"'base_model\.model\.model\.embed_tokens\.[\w.]+'"),
}  # fmt: skip
"""Adapters the serving base cannot take: what makes one, and what the refusal names."""


@pytest.mark.parametrize("kind", NOT_FOR_THIS_BASE)
def test_adapters_for_another_model_or_unservable_modules_are_refused_naming_the_module(
    kind: str, base: BaseModel, tmp_path: Path
) -> None:
    make, message = NOT_FOR_THIS_BASE[kind]
    folder = make(tmp_path / kind, base)
    with pytest.raises((BaseMismatchError, ConfigurationError), match=message):
        inspect_import(folder, base)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3", "narrow-llama"])
def test_adapter_for_another_base_is_refused_before_anything_is_registered(
    kind: str,
    base: BaseModel,
    fleet_config: MintConfig,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    make, message = NOT_FOR_THIS_BASE[kind]
    folder = make(tmp_path / kind, base)
    assert mint(["import", str(folder), "--adapter", f"alien-{kind}"]) == 1
    printed = capsys.readouterr()
    assert re.search(message, printed.out + printed.err), printed
    with pytest.raises(NotFoundError):
        Registry(fleet_config.tracking_uri).revisions.of(f"alien-{kind}")


def test_unsupported_adapters_are_refused_naming_the_problem(
    base: BaseModel, tmp_path: Path
) -> None:
    dora = made_elsewhere(
        base.model, tmp_path / "dora", LoraConfig(r=2, use_dora=True, target_modules=["q_proj"]), 1
    )
    with pytest.raises(ConfigurationError, match="use_dora=True is not supported"):
        inspect_import(dora, base)
    with pytest.raises(ConfigurationError, match="not a PEFT adapter directory"):
        inspect_import(tmp_path, base)


def test_a_fused_expert_lora_is_checked_against_the_experts(tmp_path: Path) -> None:
    base = load_base(BaseSource(str(family_folder("qwen3_moe", tmp_path / "bases"))), tmp_path)
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"],
                      target_parameters=["gate_up_proj", "mlp.experts.down_proj"])  # fmt: skip
    folder = made_elsewhere(base.model, tmp_path / "experts", lora, seed=1)
    imported = inspect_import(folder, base)
    assert imported.target_modules == ("q_proj",)
    assert imported.target_parameters == ("gate_up_proj", "mlp.experts.down_proj")
    assert imported.policy_fields()["target_parameters"] == imported.target_parameters

    weights = load_file(folder / PEFT_WEIGHTS)
    down_b = "base_model.model.model.layers.1.mlp.experts.lora_B.weight"  # [64, 2 x 4 experts]
    gate_up_a = "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"

    def damaged(name: str, key: str, tensor: torch.Tensor) -> Path:
        copy_dir = tmp_path / name
        copy_dir.mkdir()
        (copy_dir / PEFT_CONFIG).write_text((folder / PEFT_CONFIG).read_text())
        save_file({**weights, key: tensor}, copy_dir / PEFT_WEIGHTS)
        return copy_dir

    wrong_out = damaged("out", down_b, torch.zeros(32, 8))
    with pytest.raises(BaseMismatchError, match=r"has shape \[32, 8\], but it adapts "
                       r"model\.layers\.1\.mlp\.experts\.down_proj .* 4 experts of 64x32 .*"
                       r"\[64, rank\*4\]"):  # fmt: skip
        inspect_import(wrong_out, base)
    not_per_expert = damaged("per-expert", down_b, torch.zeros(64, 6))  # 6 is no rank x 4 experts
    with pytest.raises(BaseMismatchError, match=r"has shape \[64, 6\]"):
        inspect_import(not_per_expert, base)
    other_rank = damaged("rank", gate_up_a, torch.zeros(12, 64))  # rank 3, the config says 2
    with pytest.raises(ConfigurationError, match=r"rank 3 per expert over 4 experts, but the "
                       r"adapter config gives .*gate_up_proj rank 2"):  # fmt: skip
        inspect_import(other_rank, base)
    # Without target_parameters in the config, the expert keys adapt nothing MinT serves.
    no_targets = tmp_path / "no-targets"
    no_targets.mkdir()
    config = json.loads((folder / PEFT_CONFIG).read_text()) | {"target_parameters": None}
    (no_targets / PEFT_CONFIG).write_text(json.dumps(config))
    save_file(weights, no_targets / PEFT_WEIGHTS)
    with pytest.raises(
        BaseMismatchError, match=r"not a linear layer MinT can serve .*\(fused experts only as"
    ):
        inspect_import(no_targets, base)


# --- The base an adapter records ----------------------------------------------------------

SAME_WIDTH = LoraConfig(r=2, target_modules=["q_proj", "o_proj", "gate_proj", "up_proj"])
"""Projections a tiny Qwen2 and a tiny Mistral both have at one shape (their k/v differ): a
Qwen2 adapter on them fits a Mistral base tensor by tensor. (PEFT writes the base into the
config it is given: use copies.)"""


def foreign_pair(root: Path) -> tuple[Path, BaseModel]:
    """(an adapter made on a tiny Qwen2 folder, a tiny Mistral base of the same width)."""
    qwen2 = load_base(BaseSource(str(family_folder("qwen2", root / "bases"))), root)
    adapter = made_elsewhere(qwen2.model, root / "qwen2-adapter", copy.deepcopy(SAME_WIDTH), 1)
    return adapter, load_base(BaseSource(str(family_folder("mistral", root / "bases"))), root)


def recording(folder: Path, recorded: str | None, root: Path, policy: str = "") -> Path:
    """A copy of the adapter `folder` whose config records `recorded` as its base, carrying
    `policy` as its MinT policy record if given."""
    copied = root / f"copy-{len(list(root.glob('copy-*')))}"
    shutil.copytree(folder, copied)
    config = json.loads((copied / PEFT_CONFIG).read_text())
    (copied / PEFT_CONFIG).write_text(json.dumps(config | {"base_model_name_or_path": recorded}))
    if policy:
        (copied / POLICY_FILE).write_text(policy)
    return copied


def test_an_adapter_of_another_family_that_fits_the_shapes_is_refused_naming_both(
    tmp_path: Path,
) -> None:
    adapter, mistral = foreign_pair(tmp_path)
    qwen2_folder = json.loads((adapter / PEFT_CONFIG).read_text())["base_model_name_or_path"]
    assert Path(qwen2_folder).name == "tiny-qwen2"
    message = (
        rf"trained on {re.escape(qwen2_folder)} \(a qwen2 model\), but the base is tiny-mistral "
        r"\(a mistral model at .*tiny-mistral\)"
    )
    with pytest.raises(BaseMismatchError, match=message):
        inspect_import(adapter, mistral)
    # A renamed copy of a base may differ in name, never in family: no override takes it.
    with pytest.raises(BaseMismatchError, match=message):
        inspect_import(adapter, mistral, same_base_as=qwen2_folder)


def test_the_recorded_base_is_compared_by_name_folder_and_policy_digest(tmp_path: Path) -> None:
    """A full path, a folder name and a hub id of one base agree; another name is refused
    unless the import says the base is a renamed copy of it; a MinT policy record's digest
    settles it whatever the names; an adapter that records no base is refused."""
    root = tmp_path
    mistral = load_base(BaseSource(str(family_folder("mistral", root / "bases"))), root)
    made = made_elsewhere(mistral.model, root / "mistral-adapter", copy.deepcopy(SAME_WIDTH), 2)
    assert inspect_import(made, mistral).source_base == str(mistral.path)  # its own folder
    for same in ("tiny-mistral", "some-org/tiny-mistral", "/elsewhere/TINY-MISTRAL/"):
        inspect_import(recording(made, same, root), mistral)

    renamed = recording(made, "acme/mistral-7b-instruct", root)
    refused = (
        r"trained on acme/mistral-7b-instruct, but the base is tiny-mistral .* if tiny-mistral "
        r"is a renamed copy of acme/mistral-7b-instruct, say so with --same-base-as "
        "acme/mistral-7b-instruct"
    )
    with pytest.raises(BaseMismatchError, match=refused):
        inspect_import(renamed, mistral)
    with pytest.raises(BaseMismatchError, match=refused):
        inspect_import(renamed, mistral, same_base_as="acme/other-model")
    inspect_import(renamed, mistral, same_base_as="acme/mistral-7b-instruct")

    # A folder copied under another name is still that base: the config's family agrees.
    copy_folder = root / "bases" / "mistral-renamed"
    shutil.copytree(mistral.path, copy_folder)
    copy_base = load_base(BaseSource(str(copy_folder)), root)
    with pytest.raises(BaseMismatchError, match=r"--same-base-as .*tiny-mistral"):
        inspect_import(made, copy_base)
    inspect_import(made, copy_base, same_base_as=str(mistral.path))

    # A MinT policy record: the weights digest decides, the names do not.
    same_weights = make_policy(base_model_id="mint-base-v1", base_digest=mistral.digest)
    inspect_import(recording(made, "mint-base-v1", root, same_weights.to_json()), mistral)
    other_weights = make_policy(base_model_id="tiny-mistral", base_digest="sha256:" + "e" * 64)
    with pytest.raises(BaseMismatchError, match=r"trained on tiny-mistral \(weights sha256:e+\)"):
        inspect_import(recording(made, "tiny-mistral", root, other_weights.to_json()), mistral)

    for unrecorded in (None, ""):
        with pytest.raises(BaseMismatchError, match="records no base model"):
            inspect_import(recording(made, unrecorded, root), mistral)


@pytest.mark.slow
def test_mint_import_of_an_adapter_of_another_base_registers_nothing(
    fleet_config: MintConfig, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    adapter, mistral = foreign_pair(tmp_path)
    argv = ["import", str(adapter), "--adapter", "qwen2-on-mistral", "--base-model"]
    assert mint([*argv, str(mistral.path)]) == 1
    printed = capsys.readouterr()
    assert re.search(r"\(a qwen2 model\), but the base is tiny-mistral", printed.err), printed
    with pytest.raises(NotFoundError):
        Registry(fleet_config.tracking_uri).revisions.of("qwen2-on-mistral")
