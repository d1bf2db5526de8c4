"""The embedded default, built and pretrained for real once per session in MINT_HOME (about
20 s on 2 cores, shared with the session's `base`): an ordinary model folder that the Hugging
Face classes load as any user's model, and one that an adapter trained with the toy recipe
really teaches a task. The rest of the base's and training's checks run on tiny untrained
models in tests/unit (test_base_model.py, test_training.py)."""

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from mint_core.model import toy
from mint_core.model.base import BaseModel, BaseSource, load_base
from mint_core.model.datasets import parse_jsonl
from mint_core.model.tiny import IM_END, SPECIAL_TOKENS
from mint_core.model.training import TrainingConfig, exact_match, train_lora


@pytest.fixture(scope="module")
def default_base(mint_home: Path) -> BaseModel:
    """The embedded default (MINT_BASE_MODEL unset), built once per session in MINT_HOME."""
    return load_base(BaseSource(), mint_home)


def test_the_embedded_default_is_an_ordinary_model_folder(default_base: BaseModel) -> None:
    folder = default_base.path
    assert default_base.model_id == folder.name
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in folder.iterdir()
    }
    # Loaded with the Hugging Face classes directly, as any user's model would be.
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    generation = GenerationConfig.from_pretrained(folder, local_files_only=True)
    assert tokenizer.is_fast
    assert model.config.model_type == default_base.family == "llama"
    assert len(tokenizer) == model.config.vocab_size == len(SPECIAL_TOKENS) + 256
    eos = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)]
    assert sorted(generation.eos_token_id) == sorted(eos) == sorted(default_base.codec.eos_ids)

    text = "h\u00e9llo \u4e2d \U0001f600"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert len(ids) == 1 + len(text.encode())  # one token per byte
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    prompt = torch.tensor([default_base.codec.encode("abc=")])
    with torch.inference_mode():
        direct = model(prompt).logits
        loaded = default_base.model(prompt.to(default_base.device)).logits.cpu()
    assert torch.equal(direct, loaded)


@pytest.mark.slow
def test_training_is_real(mint_home: Path, tmp_path: Path) -> None:
    """The embedded default cannot reverse a word; an adapter trained with the toy recipe from
    a generated JSONL file reverses held-out words it never saw."""
    data_file = toy.write_task_data(toy.Task.REVERSE, tmp_path / "data")
    held_out_file = toy.write_held_out_data(toy.Task.REVERSE, tmp_path / "data")
    data = parse_jsonl(data_file.read_bytes(), str(data_file))
    held_out = parse_jsonl(held_out_file.read_bytes(), str(held_out_file))
    assert len(data.rows) == 12_800
    base = load_base(BaseSource(), mint_home)
    base_score = exact_match(base.model, base, held_out.rows)
    assert base_score <= 0.05

    recipe = TrainingConfig(**toy.RECIPE)  # type: ignore[arg-type]
    trained = train_lora(BaseSource(), mint_home, data, held_out, tmp_path / "adapter", recipe)
    assert trained.steps == len(trained.losses) == 400
    assert trained.eval_metrics["eval_exact_match"] >= 0.8, (base_score, trained.eval_metrics)
    first, last = trained.losses[:20], trained.losses[-20:]
    assert sum(last) < sum(first) / 4, (first, last)

    # The saved adapter, on the base as any PEFT user loads it, scores what training reported.
    adapted = PeftModel.from_pretrained(base.model, trained.path).eval()
    assert exact_match(adapted, base, held_out.rows) == trained.eval_metrics["eval_exact_match"]
    assert (trained.base_model_id, trained.base_digest) == (base.model_id, base.digest)
    assert (trained.dataset, trained.dataset_digest) == (data.source, data.digest)
