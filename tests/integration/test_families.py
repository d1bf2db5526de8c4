"""Any Hugging Face causal LM as the base: a tiny member of each supported family, built from
config with a real tokenizer and chat template and saved with `save_pretrained`, is served as
`MINT_BASE_MODEL` by a worker process of its own; an adapter released through the Prefect flow
from a JSONL file of chat rows then answers, over OpenAI chat and TGI `/generate`, with exactly
the tokens `PeftModel.generate` gives on the same folder loaded with `AutoModelForCausalLM`."""

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from peft import PeftModel
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
)

from mint_core.config import MintConfig
from mint_core.model.base import FAMILY_EXPERT_TARGETS, FAMILY_TARGETS, BaseSource
from mint_core.model.toy import Task, held_out_words, training_stream
from mint_core.registry import Registry
from mint_core.revisions import RevisionRef
from processes import ManagedProcess
from serving.worker.server import start_worker
from tests.helpers import FAMILIES, family_folder

pytestmark = pytest.mark.slow

WORDS = held_out_words(8)
NEW_TOKENS = 12


@dataclasses.dataclass(frozen=True)
class FamilyBase:
    family: str
    folder: Path
    worker: ManagedProcess
    config: MintConfig


@pytest.fixture(scope="module", params=FAMILIES)
def family_base(
    request: pytest.FixtureRequest,
    config: MintConfig,
    prefect_api: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[FamilyBase]:
    """A tiny random model of one family saved as a model folder, and a worker serving it."""
    family = request.param
    # Sharper logits than the default initialisation (0.02): greedy choices are then far from
    # ties, so the engine's batched LoRA arithmetic and PEFT's pick the same token.
    folder = family_folder(family, tmp_path_factory.mktemp("bases"), initializer_range=0.3)
    family_config = MintConfig(
        home=config.home, tracking_uri=config.tracking_uri, base=BaseSource(str(folder))
    )
    worker = start_worker(family_config)
    try:
        yield FamilyBase(
            family, folder, worker, dataclasses.replace(family_config, worker_urls=(worker.url,))
        )
    finally:
        worker.stop()


def chat_rows(path: Path, rows: int) -> Path:
    """A JSONL file of chat rows: the user says a word, the assistant reverses it."""
    stream = training_stream(Task.REVERSE, seed=3)
    with path.open("w") as out:
        for _ in range(rows):
            example = next(stream)
            messages = [
                {"role": "user", "content": example.prompt},
                {"role": "assistant", "content": example.completion},
            ]
            out.write(json.dumps({"messages": messages}) + "\n")
    return path


def reference(folder: Path, adapter_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of PEFT over the folder loaded as any Hugging Face model is."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    peft = PeftModel.from_pretrained(model, adapter_dir).eval()
    eos = list(model.generation_config.eos_token_id)
    answers = []
    for ids in prompts:
        with torch.inference_mode():
            out = peft.generate(
                input_ids=torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=0,
            )
        answers.append(out[0, len(ids) :].tolist())
    return answers


def test_an_adapter_released_on_each_family_answers_as_peft_does(
    family_base: FamilyBase, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from flows.release import release

    for name, value in family_base.config.to_env().items():
        monkeypatch.setenv(name, value)
    adapter = f"{family_base.family}-bot"
    data = chat_rows(tmp_path / "chat.jsonl", 96)
    report = release(adapter, str(data), steps=12, learning_rate=5e-3, batch_size=16)
    assert report.revision == f"{adapter}:r1"

    registered = Registry(family_base.config.tracking_uri).revisions.resolve(RevisionRef(adapter))
    policy = registered.policy
    assert policy.base_model_id == family_base.folder.name
    assert policy.dataset == str(data)
    # MoE families: attention projections as linears, experts as fused parameters.
    assert policy.target_modules == FAMILY_TARGETS[family_base.family]
    assert policy.target_parameters == FAMILY_EXPERT_TARGETS.get(family_base.family, ())
    frozen = family_base.config.frozen_root / policy.frozen_digest.removeprefix("sha256:")

    tokenizer = AutoTokenizer.from_pretrained(family_base.folder)
    chats = [[{"role": "user", "content": f"{word}="}] for word in WORDS]
    chat_prompts = [
        tokenizer.apply_chat_template(chat, add_generation_prompt=True)["input_ids"]
        for chat in chats
    ]
    plain_prompts = [tokenizer(f"{word}=")["input_ids"] for word in WORDS]
    expected_chat = reference(family_base.folder, frozen, chat_prompts)
    expected_plain = reference(family_base.folder, frozen, plain_prompts)

    url = family_base.worker.url
    for chat, expected in zip(chats, expected_chat, strict=True):
        body = {"model": adapter, "messages": chat, "max_tokens": NEW_TOKENS,
                "temperature": 0, "return_token_ids": True}  # fmt: skip
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["token_ids"] == expected, chat
        text = tokenizer.decode(expected, skip_special_tokens=True)
        assert choice["message"]["content"] == text
    for word, expected in zip(WORDS, expected_plain, strict=True):
        body = {"inputs": f"{word}=", "parameters": {"adapter_id": adapter, "details": True,
                "max_new_tokens": NEW_TOKENS}}  # fmt: skip
        response = httpx.post(f"{url}/generate", json=body, timeout=60)
        assert response.status_code == 200, response.text
        tokens = [token["id"] for token in response.json()["details"]["tokens"]]
        assert tokens == expected, word
        assert response.headers["X-Mint-Revision"] == f"{adapter}:r1"


def test_the_worker_reports_its_base(family_base: FamilyBase) -> None:
    health = httpx.get(family_base.worker.url + "/health", timeout=10).json()
    assert health["base_model"] == family_base.folder.name
    assert health["base_family"] == family_base.family
