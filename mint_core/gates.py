"""What an adapter's owners require before one of its revisions serves users.

One `Gates` record per adapter, kept as a registered-model tag (`mint.gates`) and set with
`mint gates`: every release, promotion and canary of the adapter follows it. The evaluation gate
compares the candidate with `production` on the same rows; the approval pauses the roll-out
until an allowed reviewer answers; the canary margins judge a candidate on live traffic.
"""

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Self

from mint_core.errors import ConfigurationError

GATES_TAG = "mint.gates"


@dataclass(frozen=True)
class Gates:
    eval_data: str = ""
    """JSONL rows (a path or s3:// URI) both revisions are scored on; "" = the held-out rows
    production was trained with, else the candidate's own (a candidate trained on another
    task would pass on its own rows). Imported revisions have none: with neither, the gate has
    nothing to score and says so."""
    regression_data: str = ""
    """Optional further rows, scored and gated the same way (e.g. what earlier revisions
    learned and must not forget)."""
    max_regression: float = 0.05
    """How far the candidate's exact-match rate may fall below production's, on each set."""
    requires_approval: bool = False
    approvers: tuple[str, ...] = ()
    """Who may approve or reject; with approval required and no approver named, nobody can."""
    self_approval: bool = False
    """Whether the principal who started the roll-out may approve it."""
    approval_timeout_s: int = 24 * 3600
    """A roll-out not answered within this long ends rejected."""
    canary_max_error_increase: float = 0.02
    """A canary is rolled back if its error rate exceeds production's by more than this."""
    canary_max_p95_ratio: float = 2.0
    """... or its p95 latency is more than this many times production's ..."""
    canary_max_score_drop: float = 0.1
    """... or its mean feedback score falls below production's by more than this."""
    replicas: int = 0
    """Workers of its base that hold each of its revisions (its placement); 0: the fleet's
    setting (MINT_REPLICAS). Hot revisions get more whatever this says."""

    def __post_init__(self) -> None:
        for name in ("max_regression", "canary_max_error_increase", "canary_max_score_drop"):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise ConfigurationError(f"{name}={value} must be between 0 and 1")
        if self.canary_max_p95_ratio < 1:
            raise ConfigurationError(
                f"canary_max_p95_ratio={self.canary_max_p95_ratio} must be 1 or more (a ratio "
                "of the candidate's p95 latency to production's)"
            )
        if self.replicas < 0:
            raise ConfigurationError(
                f"replicas={self.replicas} must be 0 (the fleet's MINT_REPLICAS) or more"
            )
        if self.approval_timeout_s < 1:
            raise ConfigurationError(
                f"approval_timeout_s={self.approval_timeout_s} must be at least 1 second"
            )
        object.__setattr__(self, "approvers", tuple(self.approvers))

    def may_approve(self, reviewer: str, releaser: str) -> str | None:
        """Why `reviewer` may not answer a roll-out started by `releaser`; None if they may."""
        if reviewer not in self.approvers:
            allowed = ", ".join(self.approvers) or "nobody (set approvers with `mint gates`)"
            return f"{reviewer!r} is not an approver of this adapter; its approvers: {allowed}"
        if reviewer == releaser and not self.self_approval:
            return (
                f"{reviewer!r} started this roll-out and this adapter does not allow approving "
                "one's own roll-out; another approver must answer"
            )
        return None

    def rows(self) -> list[tuple[str, str]]:
        """Each gate and its value as people read them (`mint gates`): a list as its names,
        "none" when empty."""
        return [
            (name, ", ".join(value) or "none" if isinstance(value, tuple) else str(value))
            for name, value in vars(self).items()
        ]

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Self:
        values = json.loads(text)
        known = {spec.name for spec in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigurationError(
                f"adapter gates have unknown fields {unknown}; this MinT knows {sorted(known)} "
                "(upgrade MinT to read newer records)"
            )
        return cls(**values)

    def changed(self, **changes: object) -> Self:
        """A copy with `changes` (None values left out: an option not given changes nothing)."""
        values = asdict(self) | {k: v for k, v in changes.items() if v is not None}
        return type(self)(**values)  # __post_init__ makes `approvers` a tuple


def replicas_of(tags: Mapping[str, str]) -> int:
    """The replicas an adapter's gates set, from its registered model's tags; 0 (the fleet's
    setting) when it has none, or gates this MinT cannot read (`mint gates` says why)."""
    raw = tags.get(GATES_TAG)
    if not raw:
        return 0
    try:
        return Gates.from_json(raw).replicas
    except (ConfigurationError, ValueError, TypeError):
        return 0
