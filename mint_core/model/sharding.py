"""The frozen base sharded over the ranks with FSDP2 (`--shard-base`): a base larger than one
device trains on several.

Each decoder layer is one FSDP unit and the rest of the model (embeddings, final norm, output)
the root, so a device holds its shard of everything plus one layer whole while that layer runs.
The LoRA's parameters are sharded with their layer, and FSDP reduce-scatters their gradients in
the backward: summed, not averaged, since each rank's loss is already divided by the whole
batch's tokens (`training._optimize`), so no all-reduce of our own follows. Every forward needs
every rank's shards: evaluation runs on every rank, generation kept in step (`synced_gpus`), and
the adapter is gathered whole before rank 0 saves it.

On GPUs the base is first loaded into host memory in its checkpoint's dtype: `fully_shard` moves
each rank's shard to its device, so no device ever holds the whole base. On CPUs (gloo, the
tests) it stays where it is: torch 2.13's FSDP2 takes a CPU mesh with gloo as it is.
"""

import json
from dataclasses import replace
from pathlib import Path

import torch
from peft import PeftModel
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from mint_core.distributed import Rank
from mint_core.errors import ConfigurationError
from mint_core.model.base import DTYPES, BaseSource, load_text


def staged_source(source: BaseSource, home: Path, rank: Rank) -> BaseSource:
    """Where each rank loads the base before sharding it: on a GPU rank, the host's memory in
    the dtype the rank would have trained in (the source's, else the checkpoint's), since the
    whole base may not fit the device; on CPU ranks, the source as it is."""
    if not rank.device:
        return source
    return replace(source, device="cpu", dtype=source.dtype or _checkpoint_dtype(source, home))


def shard_base(model: PeftModel, rank: Rank) -> None:
    """Shard `model` (the base with its LoRA) over all ranks, in place: one FSDP unit per
    decoder layer (the model's `_no_split_modules`), the rest in the root. Before the
    optimizer is made: it must hold the sharded parameters."""
    inner = model.get_base_model()
    layers = set(getattr(inner, "_no_split_modules", None) or ())
    if not layers:
        raise ConfigurationError(
            f"the base {type(inner).__name__} names no decoder layer class "
            "(_no_split_modules) to shard by; train it without --shard-base"
        )
    mesh = init_device_mesh("cuda" if rank.device else "cpu", (rank.size,))
    for module in inner.modules():
        if type(module).__name__ in layers:
            fully_shard(module, mesh=mesh)
    # The root is the Hugging Face model, not PEFT's wrapper: `generate` calls the former's
    # forward, whose hook must gather the embeddings.
    fully_shard(inner, mesh=mesh)
    for module in inner.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # A plain SUM: gloo has no AVG or PREMUL_SUM, and a factor of 1 needs neither.
            module.set_force_sum_reduction_for_comms(True)


def gather_adapter(model: PeftModel) -> dict[str, torch.Tensor]:
    """The LoRA's tensors whole, by state-dict name (a collective: every rank calls it, and
    all get them). PEFT's `save_pretrained` takes them as its `state_dict`."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return {
        name: (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).cpu()
        for name, tensor in model.state_dict().items()
        if name in trainable
    }


def _checkpoint_dtype(source: BaseSource, home: Path) -> str:
    """The dtype the base's config declares (what a GPU load would give it), else float32."""
    config = json.loads((load_text(source, home).path / "config.json").read_text())
    declared = config.get("dtype") or config.get("torch_dtype")
    return declared if declared in DTYPES else "float32"
