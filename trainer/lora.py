"""Many tenants' LoRAs trained at once over one frozen base: each batch row names its tenant.

Every linear layer a tenant may adapt (`Layers`: attention, MLP, the output embedding) is
wrapped once (`RoutedLora`). A tenant's adapter (`TenantLora`) holds its own A and B per
module as leaf parameters, so autograd gives each tenant exactly the gradient of its own rows'
loss, and its own AdamW steps only its own parameters. A batch is laid out with each tenant's
rows contiguous (`Router.segments`); a wrapper adds, per segment, `scale * (x @ A.T) @ B.T` of
that segment's tenant (Punica's grouped trick: one pair of matmuls per tenant present, or one
batched pair for all when the tenants have as many rows and one rank). Rows of one tenant
compute what they would alone.

The same layers are the serving engine's slot wrappers underneath (the trainer's engine wraps
the base first): a sampling step runs with no segments, a training pass with no slots.

A tenant's LoRA has PEFT's layout and scaling (`alpha / rank`, A Kaiming-uniform, B zero), so
`peft_state` is a PEFT adapter that PEFT itself and MinT's workers load.
"""

import math
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from mint_core.errors import ConfigurationError
from mint_core.model.base import ATTENTION_TARGETS, output_embedding_name, servable_modules

ALPHA = 32
"""LoRA alpha of every tenant's adapter (the SDK's `LoraConfig` has none to give); the update
is scaled by alpha / rank."""
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class Targets:
    """Which parts of the base a tenant adapts (the SDK's `LoraConfig` flags)."""

    attn: bool = True
    mlp: bool = True
    unembed: bool = True

    def select(self, layers: "Layers") -> tuple[str, ...]:
        """The module names of `layers` these flags adapt; ConfigurationError where MinT
        cannot serve what they ask for."""
        if not (self.attn or self.mlp or self.unembed):
            raise ConfigurationError(
                "train_attn, train_mlp and train_unembed are all false: a LoRA must adapt "
                "something; set at least one"
            )
        if self.mlp and layers.has_experts:
            raise ConfigurationError(
                "train_mlp=True on a mixture-of-experts base: mint trainer adapts linear "
                "layers, not fused experts; create the model with train_mlp=False"
            )
        chosen = []
        for name in layers.shapes:
            if name == layers.output:
                keep = self.unembed
            elif _is_attention(name):
                keep = self.attn
            else:
                keep = self.mlp
            if keep:
                chosen.append(name)
        if not chosen:
            raise ConfigurationError(
                f"train_attn={self.attn}, train_mlp={self.mlp}, train_unembed={self.unembed} "
                "select no linear layer of this base; set another of them"
            )
        return tuple(chosen)


@dataclass(frozen=True)
class Layers:
    """The layers of a base a tenant may adapt, read before anything wraps them."""

    shapes: Mapping[str, tuple[int, int]]
    """Module name -> (out, in) of every linear layer the serving engine serves."""
    output: str | None
    """The output embedding's module name."""
    has_experts: bool

    @classmethod
    def of(cls, model: nn.Module) -> "Layers":
        from mint_core.model.experts import experts_modules

        modules = servable_modules(model, output=True)
        return cls(
            {name: (m.out_features, m.in_features) for name, m in modules.items()},
            output_embedding_name(model),
            bool(experts_modules(model)),
        )


def _is_attention(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return last in ATTENTION_TARGETS or ".self_attn." in name or ".attention." in name


class TenantLora(nn.Module):
    """One tenant's LoRA: per adapted module, `A [rank, in]` and `B [out, rank]` (float32
    leaves whatever the base's dtype, so AdamW's state is float32 too)."""

    def __init__(
        self,
        shapes: Mapping[str, tuple[int, int]],
        rank: int,
        seed: int | None,
        device: torch.device,
    ) -> None:
        super().__init__()
        if rank < 1:
            raise ConfigurationError(f"rank={rank} must be at least 1")
        self.rank = rank
        self.scaling = ALPHA / rank
        self.names = tuple(sorted(shapes))
        generator = torch.Generator().manual_seed(seed if seed is not None else 0)
        self.A = nn.ParameterList()
        self.B = nn.ParameterList()
        for name in self.names:
            out_features, in_features = shapes[name]
            a = torch.empty(rank, in_features)
            # PEFT's default init: A Kaiming-uniform (a = sqrt(5)), B zero: the adapter
            # starts as the base.
            bound = math.sqrt(6 / ((1 + 5) * in_features))
            a.uniform_(-bound, bound, generator=generator)
            self.A.append(nn.Parameter(a.to(device)))
            self.B.append(nn.Parameter(torch.zeros(out_features, rank, device=device)))
        self._index = {name: i for i, name in enumerate(self.names)}

    def pair(self, module: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        i = self._index.get(module)
        return None if i is None else (self.A[i], self.B[i])

    def target_modules(self) -> tuple[str, ...]:
        """PEFT's `target_modules`: the adapted modules' last names."""
        return tuple(sorted({name.rsplit(".", 1)[-1] for name in self.names}))

    def peft_state(
        self, base_name_or_path: str
    ) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
        """This LoRA as a PEFT adapter: its `adapter_config.json` and its tensors (copies,
        on the CPU, under PEFT's names)."""
        config: dict[str, object] = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_name_or_path,
            "r": self.rank,
            "lora_alpha": ALPHA,
            "lora_dropout": 0.0,
            "target_modules": list(self.target_modules()),
            "bias": "none",
            "use_rslora": False,
            "use_dora": False,
            "inference_mode": True,
        }
        tensors: dict[str, torch.Tensor] = {}
        for name, a, b in zip(self.names, self.A, self.B, strict=True):
            tensors[f"{PEFT_PREFIX}{name}.lora_A.weight"] = a.detach().cpu().clone()
            tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"] = b.detach().cpu().clone()
        return config, tensors

    def load_peft(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Take the weights of a PEFT state of the same shape (`peft_state`'s, saved)."""
        expected = {
            f"{PEFT_PREFIX}{name}.lora_{side}.weight" for name in self.names for side in "AB"
        }
        if set(tensors) != expected:
            missing = sorted(expected - set(tensors))[:3]
            extra = sorted(set(tensors) - expected)[:3]
            raise ConfigurationError(
                f"the checkpoint's LoRA does not match this model's (missing {missing}, "
                f"unexpected {extra}): load it into a model of the same rank and targets"
            )
        with torch.no_grad():
            for name, a, b in zip(self.names, self.A, self.B, strict=True):
                a.copy_(tensors[f"{PEFT_PREFIX}{name}.lora_A.weight"])
                b.copy_(tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"])

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())


@dataclass(frozen=True)
class Segment:
    """Rows `start:end` of the batch, run through `lora` (None: the base alone)."""

    start: int
    end: int
    lora: TenantLora | None


class Router:
    """The segments of the training batch being run; shared by every wrapper of one model.
    Empty outside a training pass (a sampling step then sees the base and its slots)."""

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def segments(self) -> tuple[Segment, ...]:
        return getattr(self._local, "segments", ())

    @contextmanager
    def rows(self, segments: tuple[Segment, ...]) -> Iterator[None]:
        self._local.segments = segments
        try:
            yield
        finally:
            self._local.segments = ()


class RoutedLora(nn.Module):
    """A layer of the base (the engine's slot wrapper, or a plain linear) plus, per segment of
    the batch, the delta of that segment's tenant."""

    def __init__(self, name: str, inner: nn.Module, router: Router) -> None:
        super().__init__()
        self.name = name
        self.inner = inner
        self.router = router

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        segments = self.router.segments
        if not segments:
            return out
        pairs = [s.lora.pair(self.name) if s.lora is not None else None for s in segments]
        if _uniform(segments, pairs):
            # Every tenant has as many rows and a pair of one rank here: one batched matmul
            # pair for all of them (the stacked pairs keep each tenant's own gradient).
            a = torch.stack([pair[0] for pair in pairs])  # type: ignore[index]
            b = torch.stack([pair[1] for pair in pairs])  # type: ignore[index]
            scaling = torch.tensor([s.lora.scaling for s in segments], device=x.device)  # type: ignore[union-attr]
            rows = x.reshape(len(segments), -1, x.shape[-1]).to(a.dtype)
            delta = torch.bmm(torch.bmm(rows, a.transpose(1, 2)), b.transpose(1, 2))
            return out + (delta * scaling[:, None, None]).reshape(out.shape).to(out.dtype)
        deltas = []
        for segment, pair in zip(segments, pairs, strict=True):
            rows = x[segment.start : segment.end]
            if pair is None or segment.lora is None:
                deltas.append(rows.new_zeros((*rows.shape[:-1], out.shape[-1])))
                continue
            a, b = pair
            delta = (rows.to(a.dtype) @ a.T) @ b.T * segment.lora.scaling
            deltas.append(delta.to(out.dtype))
        return out + torch.cat(deltas) if len(deltas) > 1 else out + deltas[0]


def _uniform(
    segments: tuple[Segment, ...], pairs: list[tuple[torch.Tensor, torch.Tensor] | None]
) -> bool:
    """Whether several segments of equal rows all have a pair of one rank."""
    if len(segments) < 2 or any(pair is None for pair in pairs):
        return False
    rows = {s.end - s.start for s in segments}
    ranks = {pair[0].shape[0] for pair in pairs if pair is not None}
    return len(rows) == 1 and len(ranks) == 1


def wrap(model: nn.Module, names: Iterable[str], router: Router) -> dict[str, RoutedLora]:
    """Wrap each layer `names` lists (read by `Layers.of` before the engine wrapped them) in
    place; returns the wrappers by module name."""
    wrappers = {}
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        current = getattr(parent, child)  # the engine's wrapper where there is one
        wrappers[name] = RoutedLora(name, current, router)
        setattr(parent, child, wrappers[name])
    return wrappers
