"""`mint pull`: any revision's files, verified, as a PEFT folder that PEFT's own loader takes
as it is (the base found from the adapter config), answering as the worker serves it."""

import json
from pathlib import Path

import pytest
import torch
from peft import AutoPeftModelForCausalLM, LoraConfig

from mint_cli import main as mint
from mint_core.artifacts.freezing import freeze
from mint_core.artifacts.packing import pack
from mint_core.artifacts.pulling import pull
from mint_core.artifacts.stores import LocalArtifactStore, open_store
from mint_core.config import MintConfig
from mint_core.errors import ConfigurationError, IntegrityError
from mint_core.model.base import BaseModel
from mint_core.model.generate import greedy_generate
from mint_core.model.tiny import TinySpec
from mint_core.model.toy import held_out_words, prompt_for
from mint_core.model.training import save_peft
from mint_core.registry import Registry
from mint_core.revisions import RevisionRef
from processes import ManagedProcess
from serving.http.client import WorkerClient
from tests.helpers import make_policy, random_lora, tiny_base
from tests.integration.helpers import toy_release

PROMPTS = [prompt_for(word) for word in held_out_words()[:16]]


def test_pull_writes_a_registered_revision_as_a_folder_peft_loads_alone(
    mlflow_server: ManagedProcess, tmp_path: Path
) -> None:
    """A revision saved as MinT's training saves it (the base's full path in its config),
    frozen, packed, exported and registered; pulled, PEFT's own loader finds the base and
    computes what the adapter computed."""
    config = MintConfig(home=tmp_path / "home", tracking_uri=mlflow_server.url)
    spec = TinySpec(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=32,
                    pretrain_steps=0)  # fmt: skip
    base = tiny_base(spec, config.home)
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "up_proj"])
    adapter = random_lora(base.model, lora, seed=3, std=0.3)
    save_peft(adapter, tmp_path / "trained", base.name_or_path)
    packed = pack(freeze(tmp_path / "trained", config.frozen_root), tmp_path / "packed")
    store = open_store(config)
    uri = store.put(tmp_path / "packed", packed.content_digest)
    name = f"pull-{tmp_path.name[-6:].replace('_', '-')}"
    policy = make_policy(adapter=name, content_digest=packed.content_digest)
    registry = Registry(mlflow_server.url)
    revision = registry.revisions.register(policy, uri, policy.base_digest).id

    pulled = pull(registry, store, RevisionRef.parse(f"{name}:r1"), tmp_path / "pulled")
    assert (pulled.revision, pulled.content_digest) == (revision, packed.content_digest)
    assert pulled.base == str(base.path)
    loaded = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "pulled").eval()
    ids = torch.tensor([base.codec.encode("hello=")])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, adapter(ids).logits)
        assert not torch.equal(loaded(ids).logits, base.model(ids).logits)


@pytest.fixture(scope="module")
def pulled_bot(fleet_config: MintConfig) -> str:
    """An adapter trained and released by MinT (a short run, enough to move its answers)."""
    return toy_release("pulled-bot", "upper", steps=60).revision


@pytest.mark.slow
def test_a_pulled_revision_loads_with_peft_alone_and_answers_as_served(
    pulled_bot: str,
    fleet_config: MintConfig,
    base: BaseModel,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    folder = tmp_path / "pulled"
    assert mint(["pull", "pulled-bot@production", "--to", str(folder)]) == 0
    assert f"pulled {pulled_bot} into {folder}" in capsys.readouterr().out
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.path)

    # PEFT alone: the base comes from the adapter config, nothing from MinT.
    model = AutoPeftModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt_ids = [base.codec.encode(prompt) for prompt in PROMPTS]
    pulled = [g.text for g in greedy_generate(model, base.codec, prompt_ids, 20)]
    plain = [g.text for g in greedy_generate(base.model, base.codec, prompt_ids, 20)]
    assert pulled != plain, "the adapter changes nothing: the comparison would prove nothing"
    client = WorkerClient(fleet_config.worker_urls[0])
    served = [client.generate(prompt, pulled_bot) for prompt in PROMPTS]
    assert [text for text, _ in served] == pulled
    assert {revision for _, revision in served} == {pulled_bot}


@pytest.mark.slow
def test_pull_refuses_a_used_folder_and_a_damaged_artifact(
    pulled_bot: str, fleet_config: MintConfig, tmp_path: Path
) -> None:
    registry = Registry(fleet_config.tracking_uri)
    ref = RevisionRef.parse(pulled_bot)
    store = open_store(fleet_config)
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    with pytest.raises(ConfigurationError, match="not an empty folder"):
        pull(registry, store, ref, used)
    assert (used / "notes.txt").read_text() == "mine"

    # A copy of the artifact in a store of its own, one byte of a shard flipped.
    revision = registry.revisions.resolve(ref)
    damaged = LocalArtifactStore(tmp_path / "store")
    damaged.put(store.fetch(revision.artifact_uri), revision.policy.content_digest)
    shard = next(damaged.fetch(revision.artifact_uri).glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.chmod(0o644)
    shard.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=f"shard {shard.name} .* has sha256"):
        pull(registry, damaged, ref, tmp_path / "damaged")
    assert not (tmp_path / "damaged").exists()
