"""Prefect retries a step only when trying again may go otherwise: a service that did not
answer, not a refusal that is the same every time (a bad data file tried three times cost a
minute before the refusal reached the user)."""

import importlib
import pkgutil

import pytest
from prefect.states import Failed

import tasks
from mint_core.errors import (
    BaseMismatchError,
    DatasetError,
    IntegrityError,
    NotFoundError,
    RegistryError,
    ServiceError,
)
from tasks.pipeline import transient


@pytest.mark.parametrize(
    ("error", "retried"),
    [
        (DatasetError("rows.jsonl:2: not valid JSON"), False),
        (NotFoundError("data file rows.jsonl does not exist"), False),
        (IntegrityError("shard 0 has sha256 ..."), False),
        (BaseMismatchError("trained on another base"), False),
        (ServiceError("S3 artifact store does not answer"), True),
        (RegistryError("MLflow did not answer"), True),
        (ConnectionResetError("reset by peer"), True),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, BaseException) else str(value),
)
def test_only_transient_errors_are_retried(error: BaseException, retried: bool) -> None:
    assert transient(None, None, Failed(data=error)) is retried


def test_every_retried_step_retries_only_transient_errors() -> None:
    # Every module of `tasks`: the roll-out's steps gathered in `tasks.pipeline`, and those that
    # only the flows that train import (`tasks.training`, `tasks.rl`).
    modules = [
        importlib.import_module(f"tasks.{m.name}") for m in pkgutil.iter_modules(tasks.__path__)
    ]
    steps = [
        value
        for module in modules
        for value in vars(module).values()
        if hasattr(value, "retries") and hasattr(value, "retry_condition_fn")
    ]
    retried = {step.name for step in steps if step.retries}
    assert "load-data" in retried
    assert {s.name for s in steps if s.retries and s.retry_condition_fn is not transient} == set()
