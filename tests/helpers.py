"""Helpers several test modules of every lane share (fixtures stay in the conftest.py files; a
test module imports nothing from another test module): synthetic adapters, tiny bases and
tiny members of each model family built in-process, tiny engines' adapters, a policy
record, a registry held in memory as a catalog reads it, and an MLflow registry held in memory
under a real `Registry`. Nothing here starts a process or imports the process
machinery (services, workers, Prefect, S3, PostgreSQL): tests/unit imports it; what
integration tests share besides is tests/integration/helpers.py."""

import copy
import dataclasses
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Self, TypeVar

import torch
from mlflow.entities.model_registry import (
    ModelVersion,
    ModelVersionTag,
    RegisteredModel,
    RegisteredModelAlias,
    RegisteredModelTag,
)
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, RESOURCE_DOES_NOT_EXIST
from mlflow.store.entities.paged_list import PagedList
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PreTrainedConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from mint_core.artifacts.folders import publish_folder
from mint_core.errors import NotFoundError
from mint_core.model.base import BaseModel, BaseSource, load_base
from mint_core.model.generate import seeded
from mint_core.model.tiny import SPECIAL_TOKENS, TinySpec, ensure_tiny, save_base_folder
from mint_core.model.toy import held_out_words, prompt_for
from mint_core.registry import AdapterAliases, RegisteredRevision, Registry
from mint_core.revisions import PolicyRecord, RevisionId, RevisionRef
from mint_core.states import Stage

# --- Adapters made for tests ---------------------------------------------------------------


def random_lora(model: torch.nn.Module, lora: LoraConfig, seed: int, std: float) -> PeftModel:
    """A PEFT LoRA over a copy of `model` with random non-zero weights: a stand-in for one that
    learned something (PEFT initialises B to zero, which would change nothing)."""
    with seeded(seed):
        peft = get_peft_model(copy.deepcopy(model), lora)
        with torch.no_grad():
            for name, parameter in peft.named_parameters():
                if "lora_" in name:
                    parameter.normal_(0.0, std)
    return peft.eval()


def tiny_base(spec: TinySpec, home: Path) -> BaseModel:
    """A tiny base built from `spec` under `home`, loaded as any model folder is."""
    return load_base(BaseSource(str(ensure_tiny(spec, home / "base"))), home)


def make_policy(**changes: object) -> PolicyRecord:
    """A complete policy record for support-bot; `changes` replace its fields."""
    values: dict[str, object] = {
        "adapter": "support-bot",
        "content_digest": "sha256:" + "a" * 64,
        "base_model_id": "mint-tiny-llama-x",
        "base_digest": "sha256:" + "b" * 64,
        "dataset": "/data/upper.jsonl",
        "training_steps": 200,
        "dataset_digest": "sha256:" + "c" * 64,
        "lora_rank": 8,
        "lora_alpha": 16,
        "target_modules": ("q_proj", "v_proj"),
        "created_by": "alice",
        "created_at": "2026-11-29T00:00:00+00:00",
        "parent_revision": 2,
        "frozen_digest": "sha256:" + "d" * 64,
        "principals": ("team-a", "team-b"),
        "eval_metrics": {"eval_exact_match": 0.97},
    }
    values.update(changes)
    return PolicyRecord(**values)  # type: ignore[arg-type]


# --- Tiny members of each model family ---------------------------------------------------------

_SHAPE = {"vocab_size": len(SPECIAL_TOKENS) + 256, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 128,
          "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
_FAMILIES: dict[str, tuple[type[PreTrainedConfig], dict[str, object]]] = {
    # Grouped-query attention, untied embeddings.
    "llama": (LlamaConfig, {"num_key_value_heads": 2, "tie_word_embeddings": False}),
    # Biases on q/k/v, tied embeddings.
    "qwen2": (Qwen2Config, {"num_key_value_heads": 2, "tie_word_embeddings": True}),
    # q/k norms, heads of 32 over a 64-wide stream (head size is not hidden / heads).
    "qwen3": (Qwen3Config, {"num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": True}),
    # One key/value head for four query heads, untied, no sliding window.
    "mistral": (MistralConfig, {"num_key_value_heads": 1, "sliding_window": None,
                                "tie_word_embeddings": False}),
    # Fused experts (4, top-2, top-k weights renormalised as Qwen3-30B-A3B does), q/k norms.
    "qwen3_moe": (Qwen3MoeConfig, {"num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
                                   "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                   "norm_topk_prob": True, "tie_word_embeddings": True}),
    # Fused experts of intermediate_size, a router that always renormalises, untied.
    "mixtral": (MixtralConfig, {"num_key_value_heads": 2, "num_local_experts": 4,
                                "num_experts_per_tok": 2, "sliding_window": None,
                                "tie_word_embeddings": False}),
}  # fmt: skip
FAMILIES = tuple(sorted(_FAMILIES))
"""The model families MinT serves and trains, each with a tiny member built from config."""
MOE_FAMILIES = ("mixtral", "qwen3_moe")
"""Those whose MLPs are fused experts (adapted through PEFT's `target_parameters`)."""
DENSE_FAMILIES = tuple(f for f in FAMILIES if f not in MOE_FAMILIES)


def family_folder(family: str, root: Path, **changes: object) -> Path:
    """A model folder of a tiny random `family` member under `root` (built once, atomically):
    the byte tokenizer with its chat template, saved with `save_pretrained`. `changes` go to the
    config (e.g. `initializer_range`)."""
    config_class, extra = _FAMILIES[family]
    name = f"tiny-{family}" + "".join(f"-{k}-{v}" for k, v in sorted(changes.items()))
    folder = root / name
    if not folder.exists():
        with seeded(0):
            model = AutoModelForCausalLM.from_config(config_class(**_SHAPE, **extra, **changes))
        with publish_folder(folder, prefix=f".{name}-") as staging:
            save_base_folder(model, staging)
    return folder


# --- Tiny engines (engine and scheduler tests) ----------------------------------------------

ENGINE_SPEC = TinySpec(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                       pretrain_steps=0)  # fmt: skip
"""An untrained base small enough to build in a moment, for engine-level tests."""
ENGINE_PROMPTS = [prompt_for(word) for word in held_out_words(8)]
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def random_adapter(
    base: BaseModel, rank: int, seed: int, targets: list[str] | None = None
) -> tuple[LoraConfig, PeftModel]:
    """A LoRA with random (non-zero) weights; odd seeds use rsLoRA scaling."""
    lora = LoraConfig(r=rank, lora_alpha=2 * rank + seed, use_rslora=seed % 2 == 1,
                      target_modules=targets or PROJECTIONS)  # fmt: skip
    return lora, random_lora(base.model, lora, seed, std=0.2)


def config_of(lora: LoraConfig) -> dict[str, object]:
    """The adapter config an engine is given, as a packed index holds it."""
    return lora.to_dict() | {"peft_type": "LORA", "target_modules": sorted(lora.target_modules)}


def weights_of(model: PeftModel) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}


BASE_DIGEST = "sha256:" + "e" * 64
"""The base every revision of a `MemoryRegistry` is for."""


class MemoryRegistry:
    """What a catalog reads of MLflow (`RegistryReader`), held in memory: each change moves
    the adapter's last-updated time, as MLflow's does. It plays both parts a catalog reads,
    `revisions` and `changes`, so a test counts or fails a read by overriding one method."""

    def __init__(self) -> None:
        self.records: dict[RevisionId, RegisteredRevision] = {}
        self.adapters: dict[str, AdapterAliases] = {}
        self.clock_ms = 1000

    @property
    def revisions(self) -> Self:
        return self

    @property
    def changes(self) -> Self:
        return self

    def add(self, adapter: str, number: int) -> None:
        policy = make_policy(adapter=adapter, content_digest=f"sha256:{number:064d}")
        uri = f"mint-local://sha256/{number:064d}"
        self.records[RevisionId(adapter, number)] = RegisteredRevision(
            RevisionId(adapter, number), policy, uri, Stage.REGISTERED, (), {}
        )
        self.set(adapter)

    def set(self, adapter: str, share: float | None = None, **aliases: int) -> None:
        old = self.adapters.get(adapter)
        aliases_now = dict(old.aliases) if old else {}
        aliases_now.update(aliases)
        self.clock_ms += 10
        self.adapters[adapter] = AdapterAliases(
            adapter, aliases_now, self.clock_ms, BASE_DIGEST, share
        )

    def since(self, since_ms: int) -> list[AdapterAliases]:
        return [a for a in self.adapters.values() if a.updated_ms >= since_ms]

    def pages(self) -> Iterator[list[RegisteredRevision]]:
        yield list(self.records.values())

    def has_adapter(self, adapter: str) -> bool:
        return adapter in self.adapters

    def get(self, revision: RevisionId) -> RegisteredRevision:
        if revision not in self.records:
            raise NotFoundError(f"{revision} is not registered")
        named = self.adapters[revision.adapter].aliases.items()
        aliases = tuple(sorted(alias for alias, n in named if n == revision.number))
        return dataclasses.replace(self.records[revision], aliases=aliases)

    def resolve(self, ref: RevisionRef) -> RegisteredRevision:
        raise NotFoundError(f"{ref} names nothing")


# --- An MLflow registry held in memory ------------------------------------------------------


@dataclasses.dataclass
class _StoredVersion:
    source: str
    run_id: str | None
    tags: dict[str, str]
    description: str


@dataclasses.dataclass
class _StoredModel:
    description: str
    tags: dict[str, str]
    updated_ms: int
    aliases: dict[str, int] = dataclasses.field(default_factory=dict)
    versions: dict[int, _StoredVersion] = dataclasses.field(default_factory=dict)


Fault = Callable[[str, int], Exception | None]
"""(method, how many times it has been called) -> the error this call raises instead of
happening, or None."""


def _absent(what: str) -> MlflowException:
    return MlflowException(f"{what} not found", error_code=RESOURCE_DOES_NOT_EXIST)


_T = TypeVar("_T")


def _page(items: list[_T], max_results: int, page_token: str | None) -> tuple[list[_T], str | None]:
    """One page of `items` as MLflow's searches give it, and the token of the next (None at
    the end): the token is the next page's offset."""
    start = int(page_token or 0)
    after = start + max_results
    return items[start:after], (str(after) if after < len(items) else None)


class MemoryMlflow:
    """The `MlflowClient` calls the registry's parts make, over registered models and versions
    kept in memory, as MLflow's server answers them: every answer is a new entity (what was
    read does not change when the registry does); an alias or tag write leaves the model's
    last-updated time, a description or a new version moves it; an absent model, version or
    alias is refused as `RESOURCE_DOES_NOT_EXIST`. Runs are only ids: what is logged to them
    is kept in `logged`.

    `fails(method, call)` injects a fault: a call it returns an error for raises it and
    changes nothing (a server that refused, or a mover killed before that write). `calls`
    counts every call by method, `writes` lists each write that happened, in order."""

    def __init__(self) -> None:
        self.models: dict[str, _StoredModel] = {}
        self.calls: Counter[str] = Counter()
        self.writes: list[tuple[str, tuple[object, ...]]] = []
        self.logged: list[tuple[str, str]] = []
        """(run id, what was logged) per logging call."""
        self.fails: Fault = lambda method, call: None
        self.clock_ms = 1000

    def _call(self, method: str, *written: object) -> None:
        self.calls[method] += 1
        error = self.fails(method, self.calls[method])
        if error is not None:
            raise error
        if written:
            self.writes.append((method, written))

    def _model(self, name: str) -> _StoredModel:
        if name not in self.models:
            raise _absent(f"Registered Model with name={name}")
        return self.models[name]

    def _version(self, name: str, version: str) -> _StoredVersion:
        stored = self._model(name).versions.get(int(version))
        if stored is None:
            raise _absent(f"Model Version (name={name}, version={version})")
        return stored

    def _tick(self, model: _StoredModel) -> None:
        self.clock_ms += 10
        model.updated_ms = self.clock_ms

    def _registered_model(self, name: str) -> RegisteredModel:
        model = self.models[name]
        return RegisteredModel(
            name,
            last_updated_timestamp=model.updated_ms,
            description=model.description,
            tags=[RegisteredModelTag(k, v) for k, v in model.tags.items()],
            aliases=[RegisteredModelAlias(a, str(n)) for a, n in model.aliases.items()],
        )

    def _model_version(self, name: str, number: int) -> ModelVersion:
        model = self.models[name]
        stored = model.versions[number]
        return ModelVersion(
            name,
            str(number),
            creation_timestamp=0,
            description=stored.description,
            source=stored.source,
            run_id=stored.run_id,
            tags=[ModelVersionTag(k, v) for k, v in stored.tags.items()],
            aliases=sorted(a for a, n in model.aliases.items() if n == number),
        )

    # Registered models.

    def get_registered_model(self, name: str) -> RegisteredModel:
        self._call("get_registered_model")
        self._model(name)
        return self._registered_model(name)

    def create_registered_model(
        self, name: str, tags: Mapping[str, str] | None = None, description: str | None = None
    ) -> RegisteredModel:
        self._call("create_registered_model", name)
        if name in self.models:
            raise MlflowException(f"{name} exists", error_code=RESOURCE_ALREADY_EXISTS)
        self.models[name] = _StoredModel(description or "", dict(tags or {}), 0)
        self._tick(self.models[name])
        return self._registered_model(name)

    def update_registered_model(self, name: str, description: str | None = None) -> None:
        self._call("update_registered_model", name, description)
        model = self._model(name)
        model.description = description or ""
        self._tick(model)

    def set_registered_model_tag(self, name: str, key: str, value: str) -> None:
        self._call("set_registered_model_tag", name, key, value)
        self._model(name).tags[key] = value

    def delete_registered_model_tag(self, name: str, key: str) -> None:
        self._call("delete_registered_model_tag", name, key)
        self._model(name).tags.pop(key, None)

    def set_registered_model_alias(self, name: str, alias: str, version: str) -> None:
        self._call("set_registered_model_alias", name, alias, version)
        self._version(name, version)
        self._model(name).aliases[alias] = int(version)

    def delete_registered_model_alias(self, name: str, alias: str) -> None:
        self._call("delete_registered_model_alias", name, alias)
        if self._model(name).aliases.pop(alias, None) is None:
            raise _absent(f"Registered model alias {alias}")

    def search_registered_models(
        self,
        filter_string: str | None = None,
        max_results: int = 100,
        order_by: Sequence[str] | None = None,
        page_token: str | None = None,
    ) -> PagedList[RegisteredModel]:
        self._call("search_registered_models")
        names = sorted(self.models)
        if filter_string is not None:  # only the registry's own: tags.`key` = 'value'
            key, value = filter_string.removeprefix("tags.`").split("` = ", 1)
            names = [n for n in names if self.models[n].tags.get(key) == value.strip("'")]
        if order_by == ["last_updated_timestamp DESC"]:
            names.sort(key=lambda n: -self.models[n].updated_ms)
        page, token = _page(names, max_results, page_token)
        return PagedList([self._registered_model(n) for n in page], token)

    # Model versions.

    def create_model_version(
        self,
        name: str,
        source: str,
        run_id: str | None = None,
        tags: Mapping[str, str] | None = None,
        description: str | None = None,
    ) -> ModelVersion:
        self._call("create_model_version", name, source)
        model = self._model(name)
        number = max(model.versions, default=0) + 1
        model.versions[number] = _StoredVersion(source, run_id, dict(tags or {}), description or "")
        self._tick(model)
        return self._model_version(name, number)

    def get_model_version(self, name: str, version: str) -> ModelVersion:
        self._call("get_model_version")
        self._version(name, version)
        return self._model_version(name, int(version))

    def get_model_version_by_alias(self, name: str, alias: str) -> ModelVersion:
        self._call("get_model_version_by_alias")
        number = self._model(name).aliases.get(alias)
        if number is None:
            raise _absent(f"Registered model alias {alias}")
        return self._model_version(name, number)

    def set_model_version_tag(self, name: str, version: str, key: str, value: str) -> None:
        self._call("set_model_version_tag", name, version, key, value)
        self._version(name, version).tags[key] = value

    def update_model_version(self, name: str, version: str, description: str | None = None) -> None:
        self._call("update_model_version", name, version, description)
        self._version(name, version).description = description or ""

    def search_model_versions(
        self,
        filter_string: str | None = None,
        max_results: int = 10_000,
        order_by: Sequence[str] | None = None,
        page_token: str | None = None,
    ) -> PagedList[ModelVersion]:
        self._call("search_model_versions")
        names = sorted(self.models)
        if filter_string is not None:  # only the registry's own: name = 'adapter'
            names = [filter_string.removeprefix("name = ").strip("'")]
        found = [
            (name, number)
            for name in names
            if name in self.models
            for number in sorted(self.models[name].versions)
        ]
        page, token = _page(found, max_results, page_token)
        return PagedList([self._model_version(n, v) for n, v in page], token)

    # Grants: a registry without authentication (MinT's own additions to the client).

    def registered_model_writers(self, name: str) -> None:
        self._call("registered_model_writers")

    # Runs: only what a registration logs to a training run it is given.

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        self._call("log_text", run_id, artifact_file)
        self.logged.append((run_id, artifact_file))

    def log_batch(self, run_id: str, **logged: Sequence[object]) -> None:
        self._call("log_batch", run_id)
        self.logged.append((run_id, ", ".join(sorted(k for k, v in logged.items() if v))))


def memory_registry() -> tuple[Registry, MemoryMlflow]:
    """A `Registry` whose store's client is a `MemoryMlflow` (the address is never called)."""
    registry = Registry("http://mlflow.invalid")
    memory = MemoryMlflow()
    registry.store.client = memory  # type: ignore[assignment]
    return registry, memory


def register_in_memory(registry: Registry, adapter: str, count: int) -> list[RevisionId]:
    """`count` revisions of `adapter`, each with its own content, registered as trained ones
    (their training run an id: nothing is logged anywhere but in memory)."""
    revisions = []
    for number in range(1, count + 1):
        policy = make_policy(adapter=adapter, content_digest=f"sha256:{number:064x}")
        uri = "mint-local://sha256/" + policy.content_digest.removeprefix("sha256:")
        registered = registry.revisions.register(
            policy, uri, policy.base_digest, run_id=f"run-{adapter}-{number}"
        )
        revisions.append(registered.id)
    return revisions


def wait_until(check: Callable[[], object], timeout_s: float = 5.0) -> None:
    """Return once `check()` is true, polling every 10 ms; AssertionError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s")
        time.sleep(0.01)


def loaded_on_import(modules: str, names: Sequence[str], timeout_s: float = 180) -> str:
    """Import `modules` (comma-separated) in a fresh interpreter from the repository: '' if
    none of the modules `names` was loaded, else what it printed (which ones, or the error)."""
    check = (
        f"import sys, {modules}\n"
        f"loaded = [name for name in {list(names)!r} if name in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", check], cwd=root, capture_output=True, text=True, timeout=timeout_s
    )
    return "" if done.returncode == 0 else done.stderr[-2000:]
