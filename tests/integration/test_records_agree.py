"""MinT's records say the same thing wherever they are read: the training run's params and the
policy record name the same target modules, the run's `eval_data` says which rows were held
out, every exact-match figure says which rows it is on, digests are plain tags, and `mint gates`
shows names rather than Python tuples."""

import argparse
import uuid
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from mint_cli.rollout import GATE_OPTIONS, cmd_gates
from mint_core.config import MintConfig
from mint_core.gates import Gates
from mint_core.model import toy
from mint_core.model.base import BaseSource, default_targets, load_base
from mint_core.model.datasets import Dataset, parse_jsonl
from mint_core.model.tiny import TinySpec, ensure_tiny
from mint_core.model.training import TrainingConfig, train_lora
from mint_core.planning.evaluation import EvalSet, Evaluation, SetScore
from mint_core.registry import Registry
from mint_core.revisions import RevisionId
from processes import ManagedProcess
from tasks.training import load_data, train_adapter
from tests.helpers import make_policy

TINY = TinySpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, pretrain_steps=0)


def test_hyperparameters_are_names_not_python_tuples() -> None:
    params = TrainingConfig(target_modules=("q_proj", "v_proj"), expert_targets=()).params()
    assert params["target_modules"] == "q_proj,v_proj"
    assert params["expert_targets"] == "none"
    defaults = TrainingConfig().params()
    assert defaults["target_modules"] == defaults["expert_targets"] == "(the base family's default)"
    assert defaults["rank"] == "8"


def test_training_reports_the_targets_it_trained(tmp_path: Path) -> None:
    """The family's default targets, resolved on the base, are what the trained adapter's
    config and the start callback say (the run's params are logged from it)."""
    source = BaseSource(str(ensure_tiny(TINY, tmp_path / "base")))
    data, held_out = parse_jsonl(
        toy.write_task_data(toy.Task.UPPER, tmp_path / "data", rows=32).read_bytes(), "up.jsonl"
    ).split(0.25, "a")
    started: list[TrainingConfig] = []
    trained = train_lora(source, tmp_path, data, held_out, tmp_path / "adapter",
                         TrainingConfig(steps=1), on_start=started.append)  # fmt: skip
    expected = default_targets(load_base(source, tmp_path).model)
    assert len(expected) == 7
    assert started == [trained.config]
    assert trained.config.target_modules == trained.target_modules == expected
    assert trained.config.params()["target_modules"] == ",".join(expected)


def test_held_out_rows_say_whose_rows_they_are() -> None:
    rows = "".join(f'{{"prompt": "{i}=", "completion": "A"}}\n' for i in range(20))
    train, held_out = parse_jsonl(rows.encode(), "/data/train.jsonl").split(0.25, "a")
    held = len(held_out.rows)  # about a quarter: which rows is fixed by their content
    assert held_out.describe() == f"{held} held-out rows of train.jsonl"
    assert held_out.describe(path=True) == f"{held} held-out rows of /data/train.jsonl"
    assert train.describe(3) == f"3 of {20 - held} rows of train.jsonl"
    other = parse_jsonl(b'{"prompt": "a=", "completion": "A"}\n' * 4, "s3://bucket/eval.jsonl")
    assert other.describe() == "4 rows of eval.jsonl"


def test_the_gates_reason_names_where_its_rows_come_from() -> None:
    scores = (
        SetScore(EvalSet.EVAL, 50, 0.0, 0.0, "of eval.jsonl"),
        SetScore(EvalSet.REGRESSION, 20, 0.5, 0.5, "a:r1 was evaluated on in training"),
    )
    reason = Evaluation(RevisionId("a", 2), RevisionId("a", 1), scores, 0.05).reason()
    assert "a:r1 0.00 on 50 eval rows of eval.jsonl, none left out; a:r2 exact 0.50" in reason
    assert "on 20 regression rows a:r1 was evaluated on in training, none left out (max" in reason


def test_gates_show_approvers_by_name() -> None:
    rows = dict(Gates(requires_approval=True, approvers=("alice", "bob")).rows())
    assert rows["approvers"] == "alice, bob"
    assert rows["requires_approval"] == "True"
    assert dict(Gates().rows())["approvers"] == "none"


@pytest.fixture
def tiny_config(mlflow_server: ManagedProcess, tmp_path: Path) -> MintConfig:
    """The real MLflow server and a tiny untrained base (built in seconds, unlike the session's
    pretrained one): what recording needs, not what serving needs."""
    base = BaseSource(str(ensure_tiny(TINY, tmp_path / "base")))
    return MintConfig(home=tmp_path, tracking_uri=mlflow_server.url, base=base)


@pytest.mark.slow
def test_mint_gates_prints_approvers_by_name(
    tiny_config: MintConfig, capsys: pytest.CaptureFixture[str]
) -> None:
    adapter = f"gated-{uuid.uuid4().hex[:6]}"
    policy = make_policy(adapter=adapter)
    uri = "mint-local://sha256/" + policy.content_digest.removeprefix("sha256:")
    Registry(tiny_config.tracking_uri).revisions.register(policy, uri, policy.base_digest)
    options = dict.fromkeys(GATE_OPTIONS) | {"approvers": ["alice"], "requires_approval": True}
    cmd_gates(argparse.Namespace(adapter=adapter, **options), tiny_config)
    out = capsys.readouterr().out
    assert "('alice',)" not in out
    (line,) = [line for line in out.splitlines() if line.startswith("approvers")]
    assert line.split() == ["approvers", "alice"]
    assert Registry(tiny_config.tracking_uri).gates.of(adapter).approvers == ("alice",)


@pytest.mark.slow
def test_the_training_runs_params_agree_with_the_policy_record(tiny_config: MintConfig) -> None:
    """Against the real MLflow server: the run names the targets the policy lists and the rows
    held out of the training file, not the file itself."""
    data = toy.write_task_data(toy.Task.UPPER, tiny_config.home / "data", rows=64)
    adapter = f"agreeing-{uuid.uuid4().hex[:6]}"
    rows, held_out = load_data.fn(tiny_config, str(data), None, 0.1, adapter)
    trained = train_adapter.fn(tiny_config, adapter, rows, held_out, TrainingConfig(steps=2))
    params = MlflowClient(tiny_config.tracking_uri).get_run(str(trained.run_id)).data.params
    assert params["target_modules"].split(",") == list(trained.target_modules)
    assert len(trained.target_modules) == 7
    assert params["expert_targets"] == "none"
    assert params["eval_data"] == f"{len(held_out.rows)} held-out rows of {data.absolute()}"
    assert params["eval_rows"] == str(len(held_out.rows))
    assert isinstance(held_out, Dataset) and held_out.held_out
