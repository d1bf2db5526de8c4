"""Import: a PEFT LoRA adapter trained elsewhere, checked against the resident base before it
enters the release pipeline at `freeze`.

Any rank and alpha, rsLoRA or not, per-module rank and alpha patterns, any subset of the base's
linear projections and fused MoE expert parameters (PEFT's `target_parameters`). Refused,
naming what is wrong: non-LoRA adapters, DoRA, extra trained modules (`modules_to_save`,
biases, embeddings), any LoRA pair whose module is not in the base or whose shapes do not fit
it, any tensor holding NaN or infinity, and an adapter whose recorded base is another model
than the one it is checked against (`check_recorded_base`: shapes alone cannot tell a Qwen2
from a Mistral of the same width).
"""

import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import torch
from safetensors import safe_open

from mint_core.artifacts.freezing import PEFT_CONFIG, PEFT_WEIGHTS, check_finite
from mint_core.artifacts.packing import check_keys
from mint_core.errors import BaseMismatchError, ConfigurationError
from mint_core.model.base import BaseModel, BaseText, servable_modules
from mint_core.model.experts import ExpertTarget, expert_lora_targets, expert_rank
from mint_core.revisions import POLICY_FILE, PolicyRecord

_PREFIX = "base_model.model."


@dataclass(frozen=True)
class ImportedAdapter:
    """A PEFT adapter directory from outside that fits the resident base."""

    path: Path
    base_model_id: str
    """The serving base it was checked against."""
    base_digest: str
    source_base: str
    """`base_model_name_or_path` as the adapter's config records it."""
    rank: int
    alpha: int
    use_rslora: bool
    target_modules: tuple[str, ...]
    """The base's linear layer names that carry a LoRA pair (e.g. `q_proj`), sorted."""
    target_parameters: tuple[str, ...] = ()
    """Fused MoE expert parameters adapted, as the adapter config's `target_parameters`."""

    def policy_fields(self) -> dict[str, object]:
        """What the policy record says about where this revision came from."""
        return {
            "base_model_id": self.base_model_id,
            "base_digest": self.base_digest,
            "dataset": "",
            "training_steps": 0,
            "dataset_digest": "",
            "lora_rank": self.rank,
            "lora_alpha": self.alpha,
            "target_modules": self.target_modules,
            "target_parameters": self.target_parameters,
            "eval_metrics": {},
        }

    @property
    def run_id(self) -> None:
        """No MLflow run of MinT's trained it (`TrainedAdapter.run_id` names the one that did)."""
        return None

    def made(self) -> str:
        """How it came to be: its `trained` stage entry."""
        return f"trained elsewhere; imported from {self.path}"


def check_adapter_files(adapter_dir: Path) -> dict[str, object]:
    """The adapter config of `adapter_dir`, once it is a plain PEFT LoRA (no DoRA, no
    `modules_to_save`, no bias) holding only LoRA tensors, every one finite. Needs no base,
    so the CLI refuses such a folder before anything starts; `inspect_import` checks the fit."""
    config_path, weights_path = adapter_dir / PEFT_CONFIG, adapter_dir / PEFT_WEIGHTS
    if not config_path.is_file() or not weights_path.is_file():
        raise ConfigurationError(
            f"{adapter_dir} is not a PEFT adapter directory: it needs {PEFT_CONFIG} and "
            f"{PEFT_WEIGHTS} (save it with PeftModel.save_pretrained, safetensors on)"
        )
    try:
        config = json.loads(config_path.read_text())
    except ValueError as e:
        raise ConfigurationError(f"{config_path} is not JSON: {e}") from e
    _check_config(config, config_path)
    with safe_open(weights_path, framework="pt") as weights:
        keys = list(weights.keys())
        check_keys(keys)
        for key in keys:
            check_finite(key, weights.get_tensor(key), weights_path)
    return config


def inspect_import(adapter_dir: Path, base: BaseModel, same_base_as: str = "") -> ImportedAdapter:
    """Check that `adapter_dir` is a PEFT LoRA adapter made for `base`: tensor by tensor, then
    by the base it records (`same_base_as`: see `check_recorded_base`)."""
    config = check_adapter_files(adapter_dir)
    weights_path = adapter_dir / PEFT_WEIGHTS

    modules = servable_modules(base.model)
    target_parameters = config.get("target_parameters") or []
    experts = expert_lora_targets(base.model, target_parameters)
    ranks: dict[str, dict[str, int]] = {}
    with safe_open(weights_path, framework="pt") as weights:
        for key in list(weights.keys()):  # safe_open is not iterable
            module_name, _, side = key.removeprefix(_PREFIX).rpartition(".lora_")
            shape = tuple(weights.get_slice(key).get_shape())
            if key.startswith(_PREFIX) and module_name in experts:
                rank = _expert_rank(key, shape, experts[module_name], config, base)
            else:
                rank = _linear_rank(key, shape, modules.get(module_name), module_name, base)
            ranks.setdefault(module_name, {})[side[0]] = rank
    for module_name, sides in ranks.items():
        if sides.keys() != {"A", "B"} or sides["A"] != sides["B"]:
            raise ConfigurationError(
                f"{weights_path}: {module_name} needs a lora_A and a lora_B of one rank; found "
                f"ranks {sides}"
            )
    lora_modules = set(ranks)
    if not lora_modules:
        raise ConfigurationError(f"{weights_path} holds no LoRA weights")
    # After the tensors: a shape that does not fit names the module, which says more.
    check_recorded_base(adapter_dir, config, base.text, same_base_as)
    return ImportedAdapter(
        path=adapter_dir,
        base_model_id=base.model_id,
        base_digest=base.digest,
        source_base=str(config.get("base_model_name_or_path") or ""),
        rank=int(config["r"]),
        alpha=int(config["lora_alpha"]),
        use_rslora=bool(config.get("use_rslora")),
        target_modules=tuple(
            sorted({name.rsplit(".", 1)[-1] for name in lora_modules - experts.keys()})
        ),
        target_parameters=tuple(sorted(target_parameters)),
    )


def check_recorded_base(
    adapter_dir: Path, config: dict[str, object], base: BaseText, same_base_as: str = ""
) -> None:
    """Refuse (BaseMismatchError, naming both) an adapter whose recorded base is not `base`.

    What the adapter says it was trained on: a MinT policy record it carries (`policy.json`,
    base id and weights digest), else its config's `base_model_name_or_path`. The rule:
    - a policy record's base digest equal to `base.digest` is the same base, whatever the names;
    - a recorded base whose config MinT can read (a local folder, or a hub id in the local
      Hugging Face cache) and whose `model_type` is not `base.family` is another model, always;
    - otherwise the names must agree: the same folder, or the same name once each is reduced
      to its last part (`base_name`: a full path, a folder's name and a hub id `org/name` of
      one base all agree, case aside);
    - `same_base_as`, set to the recorded name, accepts a renamed copy of the base (a name or
      digest that differs, never a family that differs);
    - an adapter that records no base is refused: nothing says what it was trained on.
    """
    policy = _carried_policy(adapter_dir)
    recorded = policy.base_model_id if policy else str(config.get("base_model_name_or_path") or "")
    source = adapter_dir / (POLICY_FILE if policy else PEFT_CONFIG)
    target = f"{base.model_id} (a {base.family} model at {base.path})"
    if not recorded:
        raise BaseMismatchError(
            f"{source} records no base model (base_model_name_or_path is empty), so MinT cannot "
            f"tell whether it was trained on {target}: set base_model_name_or_path to the base "
            "it was trained on"
        )
    family = _recorded_family(recorded)
    if family and family != base.family:
        raise BaseMismatchError(
            f"{source}: the adapter was trained on {recorded} (a {family} model), but the base "
            f"is {target}: import it on the base it was trained on (--base-model)"
        )
    renamed = bool(same_base_as) and base_name(same_base_as) == base_name(recorded)
    if policy:
        if policy.base_digest == base.digest or renamed:
            return
        raise BaseMismatchError(
            f"{source}: the adapter was trained on {recorded} (weights {policy.base_digest}), "
            f"but the base is {target} (weights {base.digest}): import it on the base it was "
            f"trained on (--base-model), or, if {base.model_id} is a copy of {recorded} in "
            f"other files, say so with --same-base-as {recorded}"
        )
    if _same_base_name(recorded, base) or renamed:
        return
    raise BaseMismatchError(
        f"{source}: the adapter was trained on {recorded}, but the base is {target}: import "
        f"it on the base it was trained on (--base-model), or, if {base.model_id} is a "
        f"renamed copy of {recorded}, say so with --same-base-as {recorded}"
    )


def base_name(name: str) -> str:
    """The name a base goes by however it is written: the last part of a path or hub id, lower
    case; a Hugging Face cache snapshot (`.../models--org--name/snapshots/REV`) by its repo."""
    parts = [p for p in PurePosixPath(name.replace(os.sep, "/")).parts if p != "/"]
    for part, after in itertools.pairwise(parts):
        if part.startswith("models--") and after == "snapshots":
            return part.split("--", 2)[-1].lower()
    return parts[-1].lower() if parts else ""


def _same_base_name(recorded: str, base: BaseText) -> bool:
    path = Path(recorded).expanduser()
    if path.is_dir() and base.path.is_dir() and path.samefile(base.path):
        return True
    return base_name(recorded) in (base_name(base.model_id), base_name(str(base.path)))


def _carried_policy(adapter_dir: Path) -> PolicyRecord | None:
    """The MinT policy record an adapter folder carries (a revision's files taken out of
    MinT), if any."""
    path = adapter_dir / POLICY_FILE
    if not path.is_file():
        return None
    try:
        return PolicyRecord.from_json(path.read_text())
    except (ValueError, TypeError) as e:
        raise ConfigurationError(
            f"{path} is not a MinT policy record ({e}); remove it if it is not one"
        ) from e


def _recorded_family(recorded: str) -> str:
    """`model_type` of the recorded base's config where MinT can read it without a download
    (a local folder, a hub id in the local cache); "" otherwise."""
    path = Path(recorded).expanduser()
    config_path: Path | None = path / "config.json" if path.is_dir() else None
    if config_path is None and recorded.count("/") == 1 and not recorded.startswith((".", "/")):
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(recorded, "config.json")
        except ValueError:  # not a valid repo id
            cached = None
        config_path = Path(cached) if isinstance(cached, str) else None
    if config_path is None or not config_path.is_file():
        return ""
    try:
        return str(json.loads(config_path.read_text()).get("model_type") or "")
    except (OSError, ValueError, AttributeError):
        return ""


def _linear_rank(
    key: str, shape: tuple[int, ...], module: object, module_name: str, base: BaseModel
) -> int:
    """The rank of `key`, a LoRA tensor of the linear layer `module`, once its shape fits."""
    if not key.startswith(_PREFIX) or not isinstance(module, torch.nn.Linear):
        raise BaseMismatchError(
            f"{key!r} adapts {module_name!r}, which is not a linear layer MinT can serve on the "
            f"base {base.model_id} ({base.family}; embeddings and lm_head are not adaptable): "
            "the adapter was made for another model, or adapts modules MinT does not serve "
            "(fused experts only as the adapter config's target_parameters)"
        )
    # lora_A is [rank, in_features] and lora_B is [out_features, rank].
    fixed_axis, size = (1, module.in_features) if _is_a(key) else (0, module.out_features)
    if len(shape) != 2 or shape[fixed_axis] != size:
        raise BaseMismatchError(
            f"{key!r} has shape {list(shape)}, but {module_name} of the base "
            f"{base.model_id} is {module.out_features}x{module.in_features} (out x in); "
            "this adapter was made for another model"
        )
    return shape[1 - fixed_axis]


def _expert_rank(
    key: str,
    shape: tuple[int, ...],
    target: ExpertTarget,
    config: dict[str, object],
    base: BaseModel,
) -> int:
    """The rank of `key`, a LoRA tensor of fused expert parameter `target`, once its shape fits:
    lora_A is [rank*experts, in] and lora_B [out, rank*experts] (PEFT's ParamWrapper)."""
    fixed_axis, size = (1, target.in_features) if _is_a(key) else (0, target.out_features)
    stacked = shape[1 - fixed_axis] if len(shape) == 2 else 0
    name = f"{target.module}.{target.parameter}"
    if len(shape) != 2 or shape[fixed_axis] != size or stacked % target.experts or not stacked:
        expected = (
            f"[rank*{target.experts}, {target.in_features}]"
            if _is_a(key)
            else f"[{target.out_features}, rank*{target.experts}]"
        )
        raise BaseMismatchError(
            f"{key!r} has shape {list(shape)}, but it adapts {name} of the base "
            f"{base.model_id}, {target.experts} experts of {target.out_features}x"
            f"{target.in_features} (out x in), whose LoRA tensor is {expected}; this adapter "
            "was made for another model"
        )
    rank = stacked // target.experts
    if rank != (expected_rank := expert_rank(config, target.module, target.parameter)):
        raise ConfigurationError(
            f"{key!r} has shape {list(shape)}: rank {rank} per expert over {target.experts} "
            f"experts, but the adapter config gives {name} rank {expected_rank} (r, "
            "rank_pattern); the weights and adapter_config.json do not belong together"
        )
    return rank


def _is_a(key: str) -> bool:
    return key.endswith(".lora_A.weight")


def _check_config(config: dict[str, object], path: Path) -> None:
    if config.get("peft_type") != "LORA":
        raise ConfigurationError(
            f"{path}: peft_type is {config.get('peft_type')!r}; MinT imports LoRA adapters only"
        )
    for name, allowed in (("use_dora", (False, None)), ("modules_to_save", (None, [])),
                          ("bias", ("none", None))):  # fmt: skip
        if config.get(name) not in allowed:
            raise ConfigurationError(
                f"{path}: {name}={config.get(name)!r} is not supported: MinT serves plain LoRA "
                "pairs over a shared base; retrain without it"
            )
    patterns = config.get("target_parameters")
    if patterns is not None and (
        not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns)
    ):
        raise ConfigurationError(
            f"{path}: target_parameters={patterns!r} must be a list of parameter names"
        )
    for name in ("r", "lora_alpha"):
        value = config.get(name)
        if not isinstance(value, int | float) or value <= 0:
            raise ConfigurationError(f"{path}: {name}={value!r} must be a positive number")
