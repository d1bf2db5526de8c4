"""Adapters whose weights hold NaN or infinity: refused at import and at freeze, naming the
tensor, before anything is registered; and a revision that holds one all the same (registered
past those checks, as bytes damaged after them would be) fails prewarm on the worker, naming
the tensor, and is never ready. (A NaN that reaches a device slot anyway fails only its own
requests: tests/unit/test_scheduler.py.)"""

import re
from pathlib import Path

import httpx
import pytest
from peft import LoraConfig
from safetensors.torch import load_file, save_file

from mint_cli import main as mint
from mint_core.artifacts import freezing
from mint_core.artifacts.freezing import PEFT_WEIGHTS, freeze
from mint_core.config import MintConfig
from mint_core.errors import ConfigurationError, NotFoundError, NotReadyError
from mint_core.model import imports
from mint_core.model.base import BaseModel
from mint_core.model.imports import inspect_import
from mint_core.registry import Registry
from processes import ManagedProcess
from serving.http.client import WorkerClient
from tasks.pipeline import (
    export_adapter,
    freeze_adapter,
    pack_adapter,
    register_revision,
)
from tasks.training import check_import
from tests.helpers import random_lora

pytestmark = pytest.mark.slow

LORA = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"])


def spoiled(base: BaseModel, folder: Path, seed: int) -> tuple[Path, str]:
    """A PEFT adapter folder whose weights hold one NaN in one tensor; and that tensor's name."""
    random_lora(base.model, LORA, seed, std=0.3).save_pretrained(
        folder, save_embedding_layers=False
    )
    tensors = load_file(folder / PEFT_WEIGHTS)
    name = sorted(tensors)[1]
    tensors[name][0, 1] = float("nan")
    save_file(tensors, folder / PEFT_WEIGHTS, metadata={"format": "pt"})
    return folder, name


def names(tensor: str) -> str:
    """What an error naming `tensor` and its one NaN says."""
    return rf"tensor {re.escape(repr(tensor))} holds 1 NaN and 0 infinite values"


def test_import_check_and_freeze_refuse_a_nan_naming_the_tensor(
    base: BaseModel, tmp_path: Path
) -> None:
    folder, tensor = spoiled(base, tmp_path / "nan", seed=1)
    with pytest.raises(ConfigurationError, match=names(tensor)):
        inspect_import(folder, base)
    with pytest.raises(ConfigurationError, match=names(tensor)):
        freeze(folder, tmp_path / "frozen")
    assert not (tmp_path / "frozen").exists()


def test_mint_import_of_a_nan_adapter_registers_nothing(
    base: BaseModel,
    fleet_config: MintConfig,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    folder, tensor = spoiled(base, tmp_path / "nan", seed=2)
    assert mint(["import", str(folder), "--adapter", "nan-bot"]) == 1
    printed = capsys.readouterr()
    assert re.search(names(tensor), printed.out + printed.err)
    with pytest.raises(NotFoundError):
        Registry(fleet_config.tracking_uri).revisions.of("nan-bot")


def test_a_revision_holding_a_nan_fails_prewarm_naming_the_tensor_and_is_never_ready(
    base: BaseModel,
    config: MintConfig,
    worker: ManagedProcess,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    folder, tensor = spoiled(base, tmp_path / "nan", seed=3)
    # Past the import and freeze checks, as bytes damaged after them would be.
    with monkeypatch.context() as unchecked:
        unchecked.setattr(imports, "check_finite", lambda *_: None)
        unchecked.setattr(freezing, "check_finite_file", lambda _: None)
        imported = check_import.fn(config, folder)
        frozen = freeze_adapter.fn(config, imported.path)
    packed_dir, index = pack_adapter.fn(config, frozen)
    exported = export_adapter.fn(config, packed_dir, index)
    revision = register_revision.fn(config, "nan-artifact", imported, frozen, exported, "tests")

    client = WorkerClient(worker.url, config.worker_api_key)
    client.admit(revision)
    with pytest.raises(NotReadyError, match=rf"failed to prewarm {revision}: .*{names(tensor)}"):
        client.wait_ready(revision, timeout_s=120)
    events = httpx.get(
        f"{worker.url}/admin/events",
        headers={"Authorization": f"Bearer {config.worker_api_key}"},
        timeout=30,
    ).json()["events"]
    assert [e["state"] for e in events if e["id"] == str(revision)] == [
        "queued",
        "fetching",
        "failed",
    ]
