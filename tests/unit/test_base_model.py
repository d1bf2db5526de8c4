"""The base model is a Hugging Face model folder: where it comes from (a folder, a hub id in the
local cache, or the embedded default), its identity (a digest over its weight files, hashed
once per file version), how it is placed (MINT_DTYPE, MINT_DEVICE), what a LoRA may adapt on
it, and the refusals that say what to do. Tiny models built from config; no servers (the
embedded default itself, built for real, is tests/integration/test_default_base.py)."""

import shutil
from pathlib import Path

import huggingface_hub
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

from mint_core.config import MintConfig
from mint_core.errors import ConfigurationError
from mint_core.model import base as base_module
from mint_core.model.base import (
    DEFAULT_TARGETS,
    BaseSource,
    default_targets,
    identity,
    load_base,
    servable_modules,
)
from mint_core.model.tiny import TinySpec, ensure_tiny

TINY = TinySpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, pretrain_steps=0)

SIZES = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
FAMILIES: dict[str, tuple[type[PretrainedConfig], dict[str, object]]] = {
    "llama": (LlamaConfig, {"tie_word_embeddings": True}),
    "qwen2": (Qwen2Config, {"tie_word_embeddings": True}),
    "qwen3": (Qwen3Config, {"head_dim": 16, "tie_word_embeddings": False}),
    "mistral": (MistralConfig, {"head_dim": 8}),
    # Not one of MinT's named families: fused qkv_proj and gate_up_proj.
    "phi3": (Phi3Config, {"pad_token_id": 0}),
}


MLP = ("gate_proj", "up_proj", "down_proj")


def family_model(family: str) -> PreTrainedModel:
    """A tiny, randomly initialised member of `family`, built from config."""
    config_class, extra = FAMILIES[family]
    return AutoModelForCausalLM.from_config(config_class(**SIZES, **extra))


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A tiny base model folder of its own (tests change its files)."""
    built = ensure_tiny(TINY, tmp_path / "built")
    return Path(shutil.copytree(built, tmp_path / "models" / "tiny-base"))


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The name of each file the base's identity hashes, in order."""
    files: list[str] = []
    real = base_module.sha256_file

    def counting_sha256_file(path: Path) -> str:
        files.append(path.name)
        return real(path)

    monkeypatch.setattr(base_module, "sha256_file", counting_sha256_file)
    return files


def test_identity_is_a_digest_over_the_weight_files_hashed_once(
    folder: Path, tmp_path: Path, hashed: list[str]
) -> None:
    home = tmp_path / "home"
    source = BaseSource(str(folder))
    first = identity(source, home)
    assert first.model_id == "tiny-base"
    assert first.digest.startswith("sha256:")
    assert hashed == ["model.safetensors"]

    # Same files: the cached digest, nothing hashed again.
    assert identity(source, home) == first
    assert hashed == ["model.safetensors"]

    # Files that are not weights are not part of the identity.
    (folder / "generation_config.json").write_text('{"do_sample": false}')
    assert identity(source, home) == first

    # The same weights elsewhere (another machine's copy) have the same digest.
    copy = Path(shutil.copytree(folder, tmp_path / "elsewhere" / "tiny-base"))
    assert identity(BaseSource(str(copy)), home) == first
    assert hashed == ["model.safetensors"] * 2

    # A weight file that changes (same size, new bytes) is hashed again and changes the digest.
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    changed = identity(source, home)
    assert hashed == ["model.safetensors"] * 3
    assert changed.digest != first.digest
    assert identity(source, home) == changed
    assert hashed == ["model.safetensors"] * 3

    # Every weight file counts, in name order.
    shutil.copy(weights, folder / "model-extra.safetensors")
    assert identity(source, home).digest not in (first.digest, changed.digest)


def test_a_folder_without_weights_has_no_identity(folder: Path, tmp_path: Path) -> None:
    (folder / "model.safetensors").unlink()
    with pytest.raises(ConfigurationError, match=r"holds no weight files .*save_pretrained"):
        identity(BaseSource(str(folder)), tmp_path / "home")


def test_a_base_folder_without_a_tokenizer_is_refused_saying_what_to_do(
    folder: Path, tmp_path: Path
) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).unlink()
    with pytest.raises(
        ConfigurationError,
        match=rf"the base model tiny-base \({folder}\) has no usable tokenizer: save the model's "
        r"tokenizer beside its weights \(tokenizer\.save_pretrained; MinT needs its "
        r"tokenizer\.json\)",
    ):
        load_base(BaseSource(str(folder)), tmp_path / "home")


def test_a_folder_without_config_json_is_refused(folder: Path, tmp_path: Path) -> None:
    (folder / "config.json").unlink()
    with pytest.raises(
        ConfigurationError,
        match=rf"MINT_BASE_MODEL={folder} has no config\.json: point it at a Hugging Face model "
        "folder",
    ):
        load_base(BaseSource(str(folder)), tmp_path / "home")
    with pytest.raises(ConfigurationError, match="neither a model folder nor a hub id"):
        identity(BaseSource(str(tmp_path / "no-such-folder")), tmp_path / "home")


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty local Hugging Face cache, offline. huggingface_hub reads its environment when
    first imported, so its constants are set too."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_hub_id_missing_from_the_local_cache_says_what_to_do(
    hub_cache: Path, tmp_path: Path
) -> None:
    with pytest.raises(
        ConfigurationError,
        match=r"MINT_BASE_MODEL=Qwen/Qwen3-0\.6B is not in the local Hugging Face cache and MinT "
        r"never downloads at run time: run `hf download Qwen/Qwen3-0\.6B` first",
    ):
        load_base(BaseSource("Qwen/Qwen3-0.6B"), tmp_path / "home")


def test_a_hub_id_in_the_local_cache_loads_under_its_id(
    hub_cache: Path, folder: Path, tmp_path: Path
) -> None:
    # The cache's layout: a snapshot folder per commit, and the commit `main` points at.
    repo = hub_cache / "models--acme--tiny-base"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    base = load_base(BaseSource("acme/tiny-base"), tmp_path / "home")
    assert base.model_id == "acme/tiny-base"
    assert base.path == repo / "snapshots" / commit
    assert base.digest == identity(BaseSource(str(folder)), tmp_path / "home").digest


def test_building_a_tiny_base_reports_each_pretraining_step(tmp_path: Path) -> None:
    """What `mint up` draws its progress bar from while it builds the embedded default."""
    spec = TinySpec(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=16,
                    pretrain_steps=3, pretrain_batch_size=2)  # fmt: skip
    steps: list[tuple[int, int]] = []
    folder = ensure_tiny(spec, tmp_path, lambda step, total: steps.append((step, total)))
    assert steps == [(1, 3), (2, 3), (3, 3)]
    assert ensure_tiny(spec, tmp_path, lambda step, total: steps.append((step, total))) == folder
    assert len(steps) == 3, "built once"


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"dtype": "fp16"}, r"MINT_DTYPE='fp16' is not one of float32, bfloat16, float16"),
        ({"device": "gpu"}, r"MINT_DEVICE='gpu' is not cpu, cuda or cuda:N"),
        ({"device": "cuda:first"}, r"MINT_DEVICE='cuda:first' is not cpu, cuda or cuda:N"),
    ],
)
def test_bad_dtype_and_device_are_refused_naming_the_setting(
    setting: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        BaseSource(**setting)
    environ = {f"MINT_{name.upper()}": value for name, value in setting.items()}
    with pytest.raises(ConfigurationError, match=message):
        MintConfig.from_env(environ)


def test_dtype_and_device_place_the_model(folder: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    half = load_base(BaseSource(str(folder), dtype="bfloat16", device="cpu"), home)
    assert (half.model.dtype, half.device) == (torch.bfloat16, torch.device("cpu"))
    # float32 is the default on CPU, whatever the config says.
    assert load_base(BaseSource(str(folder), device="cpu"), home).model.dtype == torch.float32
    assert half.identity == identity(BaseSource(str(folder)), home)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_named_families_adapt_their_attention_and_mlp_projections(family: str) -> None:
    model = family_model(family)
    assert default_targets(model) == DEFAULT_TARGETS
    servable = servable_modules(model)
    # Every projection of every layer; not the output embedding, not Qwen3's q/k norms.
    assert sorted(servable) == sorted(
        f"model.layers.{layer}.{'mlp' if name in MLP else 'self_attn'}.{name}"
        for layer in range(2)
        for name in DEFAULT_TARGETS
    )
    assert model.get_output_embeddings() not in servable.values()


def test_other_families_adapt_every_linear_layer_but_the_output() -> None:
    model = family_model("phi3")
    assert default_targets(model) == ("down_proj", "gate_up_proj", "o_proj", "qkv_proj")
    assert "lm_head" not in servable_modules(model)


@pytest.mark.parametrize("tied", [True, False])
def test_servable_modules_leave_out_lm_head_tied_or_not(tied: bool) -> None:
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SIZES, tie_word_embeddings=tied))
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    names = servable_modules(model)
    assert not any(name.endswith(("lm_head", "embed_tokens")) for name in names)
    assert len(names) == 2 * len(DEFAULT_TARGETS)
