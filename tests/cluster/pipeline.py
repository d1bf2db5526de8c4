"""The pipeline of the serving scenarios (tests/cluster/scenarios_serving.py): one process in
the client host with the train hosts' settings (an operator's machine), running MinT's own
import and promote flows against ctl's Prefect and MLflow, asked through files on the shared
disk (request N.json, answer N.out.json). It loads torch and the base once, so a promotion
costs its flow, not a process start.

    python -m tests.cluster.pipeline FOLDER      (run inside the client host by `Pipeline`)
"""

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from mint_core.errors import ServiceError
from tests.cluster import roles
from tests.cluster.roles import CLIENT, CONTROL, Booted

if TYPE_CHECKING:
    import torch

TIMEOUT_S = 240.0
"""One import or promotion on a busy 2-core machine (the first waits for torch and the base)."""


class Pipeline:
    """The pipeline process in the client host, started at construction; `close()` of the
    cluster stops it."""

    def __init__(self, booted: Booted) -> None:
        cluster = booted.cluster
        self.folder = cluster.state_dir / CLIENT / "pipeline"
        self.folder.mkdir(parents=True, exist_ok=True)
        env = roles.role_env(cluster, CLIENT, roles.home_of(cluster, CONTROL), booted.pipeline_env)
        argv = [sys.executable, "-m", "tests.cluster.pipeline", str(self.folder)]
        self.process = cluster.run(CLIENT, "pipeline", argv, env, grace_s=15.0)
        self._count = 0

    def ask(self, **request: object) -> dict:
        """The answer to `request` ({"op": "import", "adapter", "seed"} or {"op": "promote",
        "adapter", "revision"}): {"ok", "result", "t_start", "t_end"} (wall-clock seconds);
        ServiceError if it failed or took too long (naming the log)."""
        self._count += 1
        name = f"{self._count:04d}"
        (self.folder / f"{name}.tmp").write_text(json.dumps(request))
        (self.folder / f"{name}.tmp").rename(self.folder / f"{name}.json")
        answer_path = self.folder / f"{name}.out.json"
        deadline = time.monotonic() + TIMEOUT_S
        while not answer_path.exists():
            if self.process.process.poll() is not None or time.monotonic() > deadline:
                raise ServiceError(
                    f"the pipeline in {CLIENT} did not answer {request}; its log: "
                    f"{self.process.log_path}"
                )
            time.sleep(0.1)
        answer = json.loads(answer_path.read_text())
        if not answer["ok"]:
            raise ServiceError(f"the pipeline failed {request}: {answer['error']}")
        return answer


def serve(folder: Path) -> None:
    """Answer each request file in `folder` in turn, forever (stopped by SIGTERM)."""
    from flows.promote import promote
    from mint_core.config import MintConfig
    from mint_core.model.base import load_base

    config = MintConfig.from_env()
    base = load_base(config.base, config.home)
    while True:
        for path in sorted(folder.glob("[0-9]*.json")):
            if path.name.endswith(".out.json") or path.with_suffix(".out.json").exists():
                continue
            request = json.loads(path.read_text())
            answer: dict[str, object] = {"t_start": time.time()}
            try:
                if request["op"] == "import":
                    answer["result"] = _import(base.model, request["adapter"], request["seed"])
                else:
                    adapter, revision = request["adapter"], request["revision"]
                    answer["result"] = promote(adapter, revision, actor="cluster-test")
                answer["ok"] = True
            except Exception as e:  # reported to the test, which fails on it
                answer.update(ok=False, error=f"{type(e).__name__}: {e}")
            answer["t_end"] = time.time()
            done = path.with_suffix(".tmp")
            done.write_text(json.dumps(answer))
            done.rename(folder / f"{path.stem}.out.json")
        time.sleep(0.1)


def _import(model: "torch.nn.Module", adapter: str, seed: int) -> str:
    """A random LoRA (tests.helpers.random_lora) imported as the next revision of `adapter`
    through the import flow (check, freeze, pack, export, register, roll-out): the revision,
    production once it returns."""
    from peft import LoraConfig

    from flows.release import import_adapter
    from tests.helpers import random_lora

    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    with tempfile.TemporaryDirectory() as folder:
        random_lora(model, lora, seed, std=0.3).save_pretrained(folder)
        report = import_adapter(adapter, folder, actor="cluster-test")
    return str(report.revision)


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
