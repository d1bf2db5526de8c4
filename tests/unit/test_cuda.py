"""The model side on a CUDA device (`MINT_DEVICE=cuda`): the engine answers as on the CPU,
training runs there, and a packed adapter loads into pinned host memory. Skipped on machines
without CUDA (CI has none); run them where there is one."""

from pathlib import Path

import pytest
import torch

from bench.transfer import slot_load_bandwidth
from mint_core.artifacts.freezing import freeze
from mint_core.artifacts.packing import load, pack
from mint_core.model.base import BaseSource, load_base
from mint_core.model.datasets import parse_jsonl
from mint_core.model.tiny import ensure_tiny
from mint_core.model.toy import Task, write_held_out_data, write_task_data
from mint_core.model.training import TrainingConfig, train_lora
from serving.engine.engine import TorchEngine
from tests.helpers import ENGINE_PROMPTS, ENGINE_SPEC, config_of, random_adapter, weights_of

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_the_engine_on_cuda_gives_the_cpu_engines_tokens(tmp_path: Path) -> None:
    folder = str(ensure_tiny(ENGINE_SPEC, tmp_path / "base"))
    cpu = load_base(BaseSource(folder, device="cpu"), tmp_path)
    gpu = load_base(BaseSource(folder, dtype="float32", device="cuda"), tmp_path)
    assert gpu.device.type == "cuda"
    assert gpu.digest == cpu.digest
    lora, peft = random_adapter(cpu, rank=4, seed=1)
    answers = []
    for base in (cpu, gpu):
        engine = TorchEngine(base, slots=2)
        engine.load(engine.prepare("a", config_of(lora), weights_of(peft)))
        keys = ["a"] * len(ENGINE_PROMPTS)
        answers.append([g.token_ids for g in engine.generate(ENGINE_PROMPTS, keys, 8)])
    assert answers[0] == answers[1]


def test_training_runs_on_cuda_and_a_packed_adapter_loads_pinned(tmp_path: Path) -> None:
    folder = str(ensure_tiny(ENGINE_SPEC, tmp_path / "base"))
    data = write_task_data(Task.UPPER, tmp_path / "data", rows=64)
    held = write_held_out_data(Task.UPPER, tmp_path / "data", count=8)
    trained = train_lora(
        BaseSource(folder, device="cuda"),
        tmp_path,
        parse_jsonl(data.read_bytes(), str(data)),
        parse_jsonl(held.read_bytes(), str(held)),
        tmp_path / "adapter",
        TrainingConfig(steps=3, batch_size=8),
    )
    assert len(trained.losses) == 3
    packed = tmp_path / "packed"
    pack(freeze(trained.path, tmp_path / "frozen"), packed)
    loaded = load(packed)
    assert all(tensor.is_pinned() for tensor in loaded.tensors.values())


def test_a_slot_load_copies_one_pinned_staged_buffer_to_the_device(tmp_path: Path) -> None:
    folder = str(ensure_tiny(ENGINE_SPEC, tmp_path / "base"))
    cpu = load_base(BaseSource(folder, device="cpu"), tmp_path)
    lora, peft = random_adapter(cpu, rank=4, seed=1)
    engine = TorchEngine(load_base(BaseSource(folder, dtype="float32", device="cuda"), tmp_path))
    weights = engine.prepare("a", config_of(lora), weights_of(peft))
    assert weights.staged is not None and weights.staged.is_pinned()
    engine.load(weights)
    held = [t for w in engine._wrappers.values() for a, b, _ in w.pairs.values() for t in (a, b)]
    assert held and all(t.device.type == "cuda" for t in held)
    engine.unload("a")
    figures = slot_load_bandwidth(engine, weights)
    assert figures is not None and figures["bytes"] == weights.staged.nbytes
    assert figures["slot_load_bytes_per_s"] > 0 and figures["pinned_copy_bytes_per_s"] > 0
