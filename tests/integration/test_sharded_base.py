"""`--shard-base`: 2 processes (torchrun, gloo on CPU) with the frozen base sharded by FSDP2
train the adapter 1 process trains in-process: the same LoRA, losses and held-out metrics,
within float32 summation order, and the result says the base was sharded."""

from pathlib import Path

import pytest
from safetensors.torch import load_file

from mint_core.distributed import Launch
from mint_core.model import toy
from mint_core.model.base import BaseSource
from mint_core.model.datasets import Dataset, parse_jsonl
from mint_core.model.tiny import TinySpec, ensure_tiny
from mint_core.model.training import TrainingConfig, TrainJob, train_lora
from processes import free_port
from processes.torchrun import start_ranks

SPEC = TinySpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, pretrain_steps=0)
CONFIG = TrainingConfig(steps=4, batch_size=8, gradient_accumulation=2, learning_rate=1e-2)
TOLERANCE = 1e-5
"""Largest difference allowed in a LoRA weight, a loss or the eval loss: FSDP's reduce-scatter
sums the same float32 terms in another order than one process does (measured: 6e-7 in a
weight, 2e-7 in a loss)."""


@pytest.mark.slow
def test_two_ranks_with_a_sharded_base_train_one_process_adapter(tmp_path: Path) -> None:
    home = tmp_path / "home"
    source = BaseSource(str(ensure_tiny(SPEC, home / "base")))

    def rows(path: Path) -> Dataset:
        return parse_jsonl(path.read_bytes(), str(path))

    data = rows(toy.write_task_data(toy.Task.UPPER, tmp_path, rows=32))
    held = rows(toy.write_held_out_data(toy.Task.UPPER, tmp_path, count=4))
    one = train_lora(source, home, data, held, tmp_path / "one", CONFIG)

    job = TrainJob(source, home, data, held, tmp_path / "two", CONFIG, shard_base=True)
    launch = Launch(nproc_per_node=2, shard_base=True)
    with start_ranks(
        launch,
        tmp_path / "run",
        ("127.0.0.1", free_port()),
        job=("mint_core.model.training:train_rank", job),
    ) as ranks:
        two = ranks.result(lambda event: None)

    assert two.world.size == 2 and two.world.sharded_base and two.world.backend == "gloo"
    expected = load_file(one.path / "adapter_model.safetensors")
    got = load_file(two.path / "adapter_model.safetensors")
    assert expected.keys() == got.keys()
    assert max((expected[k] - got[k]).abs().max().item() for k in expected) < TOLERANCE
    assert max(abs(a - b) for a, b in zip(one.losses, two.losses, strict=True)) < TOLERANCE
    assert abs(one.eval_metrics["eval_loss"] - two.eval_metrics["eval_loss"]) < TOLERANCE
    assert one.eval_metrics["eval_exact_match"] == two.eval_metrics["eval_exact_match"]
