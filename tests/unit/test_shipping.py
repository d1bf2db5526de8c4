"""`mint_core.shipping.ship` over fake steps: the four run in order, each under its stage's
name, each fed what the one before made, and register gets the shipment's fields and the stage
history's start (trained, frozen, packed, exported). No MLflow, no store, no Prefect."""

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ParamSpec, TypeVar

import pytest

from mint_core.artifacts.freezing import FrozenAdapter
from mint_core.artifacts.packing import PackedIndex
from mint_core.config import MintConfig
from mint_core.model.datasets import Dataset, Row
from mint_core.model.imports import ImportedAdapter
from mint_core.model.training import TrainedAdapter, TrainingConfig
from mint_core.registry import StageMark
from mint_core.revisions import RevisionId, RevisionRef
from mint_core.shipping import Exported, Shipment, Steps, ship, untimed
from mint_core.states import Stage

P = ParamSpec("P")
R = TypeVar("R")

CONFIG = MintConfig()
FROZEN = FrozenAdapter(Path("/frozen/abc"), "sha256:abc", {})
PACKED_DIR = Path("/packed/abc")
INDEX = PackedIndex({}, {}, (), "sha256:packed")
EXPORTED = Exported("s3://mint/abc", "sha256:packed")
REVISION = RevisionId("bot", 3)


def trained(path: Path = Path("/adapters/bot")) -> TrainedAdapter:
    return TrainedAdapter(
        path=path,
        config=TrainingConfig(),
        target_modules=("q_proj",),
        target_parameters=(),
        base_model_id="tiny",
        base_digest="sha256:base",
        dataset="rows.jsonl",
        dataset_digest="sha256:rows",
        steps=7,
        losses=(),
    )


def imported(path: Path = Path("/outside/bot")) -> ImportedAdapter:
    return ImportedAdapter(path, "tiny", "sha256:base", "tiny", 8, 16, False, ("q_proj",))


@dataclass
class Recorder:
    """Fake steps that note each call and answer the fixed values above, and a clock that notes
    each stage it runs."""

    calls: list[tuple[str, tuple[object, ...], dict[str, object]]] = field(default_factory=list)
    stages: list[str] = field(default_factory=list)

    def step(self, name: str, answer: object) -> Callable[..., object]:
        def run(*args: object, **kwargs: object) -> object:
            self.calls.append((name, args, kwargs))
            return answer

        return run

    def steps(self) -> Steps:
        return Steps(
            self.step("freeze", FROZEN),  # type: ignore[arg-type]
            self.step("pack", (PACKED_DIR, INDEX)),  # type: ignore[arg-type]
            self.step("export", EXPORTED),  # type: ignore[arg-type]
            self.step("register", REVISION),  # type: ignore[arg-type]
        )

    def timed(self, stage: str, step: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        self.stages.append(stage)
        return step(*args, **kwargs)

    def register_kwargs(self) -> dict[str, object]:
        (register,) = [kwargs for name, _, kwargs in self.calls if name == "register"]
        return register


def test_ship_runs_the_steps_in_order_each_fed_the_one_before() -> None:
    recorder = Recorder()
    source = trained()
    revision = ship(CONFIG, Shipment("bot", source, "ann"), recorder.steps(), recorder.timed)

    assert revision == REVISION
    assert recorder.stages == ["freeze", "pack", "export", "register"]
    assert [(name, args) for name, args, _ in recorder.calls[:3]] == [
        ("freeze", (CONFIG, source.path)),
        ("pack", (CONFIG, FROZEN)),
        ("export", (CONFIG, PACKED_DIR, INDEX)),
    ]


def test_register_gets_the_shipment_and_the_stage_history_start() -> None:
    recorder = Recorder()
    source = trained()
    parent = RevisionRef.parse("bot@production")
    held_out = Dataset("eval.jsonl", "sha256:eval", (Row(1, "2+2", "4"),))
    trained_on = Dataset("train.jsonl", "sha256:train", (Row(1, "1+1", "2"),))
    shipment = Shipment("bot", source, "ann", ("ann",), held_out, parent, trained_on)
    ship(CONFIG, shipment, recorder.steps(), recorder.timed)

    register = recorder.register_kwargs()
    reached = register.pop("reached")
    assert register == {
        "config": CONFIG,
        "adapter": "bot",
        "source": source,
        "frozen": FROZEN,
        "exported": EXPORTED,
        "actor": "ann",
        "principals": ("ann",),
        "held_out": held_out,
        "parent": parent,
        "trained_on": trained_on,
    }
    assert isinstance(reached, tuple)
    assert all(isinstance(mark, StageMark) for mark in reached)
    assert [(mark.stage, mark.reason) for mark in reached] == [
        (Stage.TRAINED, "7 steps on rows.jsonl"),
        (Stage.FROZEN, "files sha256:abc"),
        (Stage.PACKED, "0 shards"),
        (Stage.EXPORTED, "s3://mint/abc"),
    ]
    assert [mark.at for mark in reached] == sorted(mark.at for mark in reached)


def test_an_imported_adapter_says_where_it_came_from() -> None:
    recorder = Recorder()
    ship(CONFIG, Shipment("bot", imported(), "ann"), recorder.steps(), recorder.timed)

    trained_mark = recorder.register_kwargs()["reached"][0]  # type: ignore[index]
    assert trained_mark.reason == "trained elsewhere; imported from /outside/bot"


def test_without_recording_steps_the_history_starts_at_registered() -> None:
    recorder = Recorder()
    ship(
        CONFIG,
        Shipment("bot", trained(), "ann"),
        recorder.steps(),
        recorder.timed,
        record_steps=False,
    )

    assert recorder.stages == ["freeze", "pack", "export", "register"]
    assert recorder.register_kwargs()["reached"] == ()


@pytest.mark.parametrize("failing", ["freeze", "pack", "export", "register"])
def test_a_failing_step_stops_the_shipment_there(failing: str) -> None:
    recorder = Recorder()

    def refuse(*args: object, **kwargs: object) -> object:
        raise RuntimeError(f"{failing} failed")

    steps = replace(recorder.steps(), **{failing: refuse})
    with pytest.raises(RuntimeError, match=f"{failing} failed"):
        ship(CONFIG, Shipment("bot", trained(), "ann"), steps, recorder.timed)

    order = ["freeze", "pack", "export", "register"]
    assert recorder.stages == order[: order.index(failing) + 1]
    assert [name for name, _, _ in recorder.calls] == order[: order.index(failing)]


def test_untimed_only_runs_the_step() -> None:
    assert untimed("pack", lambda a, b=0: (a, b), 1, b=2) == (1, 2)
