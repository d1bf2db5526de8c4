"""Adapters, revisions and their policy records.

An adapter is a named line of fine-tunes (`support-bot`); a revision is one frozen payload of
it, numbered by its MLflow model version (`support-bot:r3`); an alias is a movable name on a
revision (`support-bot@production`). The policy record says how a revision may be used and
where it came from; it converts to and from JSON and MLflow tags here and nowhere else.
"""

import json
import re
from collections.abc import Mapping
from dataclasses import MISSING, Field, asdict, dataclass, field, fields
from typing import Self

from mint_core.errors import ConfigurationError, clip

PRODUCTION = "production"
CANDIDATE = "candidate"
"""The alias a release sets while the fleet prewarms a revision, before `production` moves."""
CANARY = "canary"
"""The alias of a revision that serves a share of `production`'s requests while it is watched
(`registry.canary.start`); the share is a registered-model tag beside it."""
TAG_PREFIX = "mint."
POLICY_SCHEMA_VERSION = 1
POLICY_FILE = "policy.json"
"""The file a policy record is written to beside a revision's files (the MLflow run's artifact
of the same name), and that an adapter folder taken out of MinT may carry."""

MAX_REVISION = 2**63 - 1
"""The largest revision number: MLflow numbers model versions with integers its database holds
in a signed 64-bit column (SQLite's INTEGER), so a larger one can name nothing."""

# Names and references are matched whole (fullmatch: `$` alone lets a trailing newline
# through) over ASCII only (`\d` and `\w` take any script's digits and letters).
_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}", re.ASCII)
_ALIAS = _NAME  # an alias follows an adapter name's rules
_REF = re.compile(
    r"(?P<adapter>[^:@]+)(?::r(?P<revision>[0-9]+)|@(?P<alias>[^:@]*))?", re.ASCII | re.DOTALL
)


def _echo(text: str) -> str:
    """`text` as a message quotes it: cut short (`clip`), repr'd."""
    return repr(clip(text))


def check_adapter_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ConfigurationError(
            f"adapter name {_echo(name)} is not valid; use 1-64 lower-case letters, digits, '-' "
            "or '_', starting with a letter or digit"
        )
    return name


def check_alias_name(alias: str) -> str:
    if not _ALIAS.fullmatch(alias):
        raise ConfigurationError(
            f"alias {_echo(alias)} is not valid; use 1-64 lower-case letters, digits, '-' or "
            "'_', starting with a letter or digit (e.g. 'production')"
        )
    return alias


def check_revision_number(number: int, ref: str = "") -> int:
    """`number` if a registry can hold it as a revision: 1 to MAX_REVISION."""
    where = f" in {_echo(ref)}" if ref else ""
    if number < 1:
        raise ConfigurationError(f"revision r{number}{where} must be r1 or later")
    if number > MAX_REVISION:
        # Not written out: a number of thousands of digits is past what str() converts.
        raise ConfigurationError(
            f"the revision{where} is larger than any revision can be (at most r{MAX_REVISION})"
        )
    return number


@dataclass(frozen=True)
class RevisionRef:
    """What a caller asks for: `name` (= `name@production`), `name@alias` or `name:rN`."""

    adapter: str
    revision: int | None = None
    alias: str | None = None
    """Set when `revision` is not; defaults to `production`."""

    def __post_init__(self) -> None:
        if self.revision is not None and self.alias is not None:
            raise ConfigurationError(
                f"{self.adapter}: name a revision (r{self.revision}) or an alias "
                f"({self.alias}), not both"
            )
        if self.revision is None and self.alias is None:
            object.__setattr__(self, "alias", PRODUCTION)

    @classmethod
    def parse(cls, text: str) -> Self:
        match = _REF.fullmatch(text.strip())
        if not match:
            raise ConfigurationError(
                f"adapter reference {_echo(text)} is not valid; write 'name', 'name@alias' or "
                "'name:rN' (e.g. 'support-bot:r3')"
            )
        adapter = check_adapter_name(match["adapter"])
        if (digits := match["revision"]) is not None:
            # Counted before int(): a number of thousands of digits is past any revision by its
            # length, and past what Python converts from a string.
            too_long = len(digits.lstrip("0")) > len(str(MAX_REVISION))
            number = MAX_REVISION + 1 if too_long else int(digits)
            return cls(adapter, revision=check_revision_number(number, text))
        alias = match["alias"]
        return cls(adapter, alias=PRODUCTION if alias is None else check_alias_name(alias))

    def __str__(self) -> str:
        if self.revision is not None:
            return f"{self.adapter}:r{self.revision}"
        return f"{self.adapter}@{self.alias}"


@dataclass(frozen=True)
class RevisionId:
    """One exact revision: `name:rN`."""

    adapter: str
    number: int

    def __str__(self) -> str:
        return f"{self.adapter}:r{self.number}"


def parse_pins(text: str) -> tuple[RevisionId, ...]:
    """The revisions MINT_PINS (`name:rN,...`) names; an alias is refused, pins are exact."""
    pins = []
    for entry in filter(None, (part.strip() for part in text.split(","))):
        ref = RevisionRef.parse(entry)
        if ref.revision is None:
            raise ConfigurationError(
                f"MINT_PINS entry {entry!r} names an alias; pin exact revisions, 'name:rN'"
            )
        pins.append(RevisionId(ref.adapter, ref.revision))
    return tuple(pins)


@dataclass(frozen=True)
class PolicyRecord:
    """How a revision may be used and where it came from. Immutable once registered."""

    adapter: str
    content_digest: str
    """sha256 over the adapter config and every tensor's key, dtype, shape and byte digest:
    the adapter's content, whatever packer wrote it."""
    base_model_id: str
    base_digest: str
    """The base model's weights digest; the serving base must match it."""
    training_steps: int
    dataset_digest: str
    lora_rank: int
    lora_alpha: int
    target_modules: tuple[str, ...]
    created_by: str
    created_at: str
    """ISO-8601 UTC time the revision was frozen."""
    dataset: str = ""
    """Where the training data came from: its path or URI ("" for an imported adapter)."""
    parent_revision: int | None = None
    """The revision this one replaces in its adapter's line, if any."""
    frozen_digest: str | None = None
    """Digest of the frozen PEFT files: what the artifact is re-exported from if it is lost."""
    principals: tuple[str, ...] = ("*",)
    """Who may use it; `*` is everyone."""
    eval_metrics: Mapping[str, float] = field(default_factory=dict)
    target_parameters: tuple[str, ...] = ()
    """Fused MoE expert parameters the LoRA adapts (PEFT's `target_parameters`); () for none.
    Records from before expert LoRA lack it and read as ()."""
    trained_with: Mapping[str, object] = field(default_factory=dict)
    """How it was trained: world_size, train_hosts, dist_backend (`mint_core.distributed.World`);
    empty for an imported adapter and records from before distributed training."""
    schema_version: int = POLICY_SCHEMA_VERSION

    def to_json(self, compact: bool = False) -> str:
        """Indented for people (the release's artifact); compact for indexes."""
        if compact:
            return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Self:
        return cls._from_dict(json.loads(text))

    def to_tags(self) -> dict[str, str]:
        """Flat `mint.*` string tags, as MLflow stores them and its UI shows them."""
        # Text stays readable in the MLflow UI (an optional text that is None gets no tag);
        # everything else is JSON.
        values = asdict(self)
        return {
            TAG_PREFIX + spec.name: value if _is_text(spec) else json.dumps(value, sort_keys=True)
            for spec in fields(self)
            if (value := values[spec.name]) is not None or not _is_text(spec)
        }

    @classmethod
    def from_tags(cls, tags: Mapping[str, str]) -> Self:
        values: dict[str, object] = {}
        for spec in fields(cls):
            raw = tags.get(TAG_PREFIX + spec.name)
            if raw is None:
                continue
            if spec.type is str:
                values[spec.name] = raw
            elif _is_text(spec):
                # Records written before optional text was stored plain hold it as JSON: a
                # quoted string, or null. A digest or a path never starts with a quote.
                values[spec.name] = json.loads(raw) if raw == "null" or raw[:1] == '"' else raw
            else:
                values[spec.name] = json.loads(raw)
        return cls._from_dict(values)

    @classmethod
    def _from_dict(cls, values: dict[str, object]) -> Self:
        version = values.get("schema_version", POLICY_SCHEMA_VERSION)
        if version != POLICY_SCHEMA_VERSION:
            raise ConfigurationError(
                f"policy record schema version {version!r} is not supported; this MinT reads "
                f"version {POLICY_SCHEMA_VERSION} (upgrade MinT to read newer records)"
            )
        missing = [f.name for f in fields(cls) if f.name not in values and _required(f)]
        if missing:
            raise ConfigurationError(f"policy record lacks required fields {missing}")
        for name in ("target_modules", "principals", "target_parameters"):
            if name in values:
                values[name] = tuple(values[name])  # type: ignore[arg-type]
        return cls(**values)  # type: ignore[arg-type]


def _is_text(spec: Field[object]) -> bool:
    """Whether a policy field holds text, perhaps optional (`str | None`)."""
    return spec.type in (str, str | None)


def _required(spec: Field[object]) -> bool:
    return spec.default is MISSING and spec.default_factory is MISSING
