"""The `rl` flow on a tiny Qwen3-MoE served by a worker of its own: a zero LoRA (attention and
every expert) ships as r1 on `rl`, four GRPO steps sample from `rl` with routes and replay
them, and two syncs ship r2 and r3. Each step's figures are in the run's MLflow run, each
attributed to the revision that sampled it; each revision records its parent, step and
`rl:<task>`. A second run starts from r2 at another rank: it ships r2's adapter again as r4
(parent r2), trains against r2 as its KL reference, and its r5 keeps r2's LoRA shape; a start
that is another adapter's or not registered is refused before anything is registered. (Whether
GRPO learns is bench/rl.py's question, not this test's.)"""

import dataclasses
from collections.abc import Iterator

import pytest
from mlflow import MlflowClient

from mint_core.config import MintConfig
from mint_core.errors import ConfigurationError, NotFoundError
from mint_core.model.base import BaseSource
from mint_core.model.tiny import TinySpec, ensure_tiny
from mint_core.registry import Registry
from mint_core.revisions import RevisionId, RevisionRef
from processes import ManagedProcess
from serving.worker.server import start_worker

SPEC = TinySpec(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=32, num_experts=4,
                pretrain_steps=0)  # fmt: skip
EXPERTS = ("mlp.experts.down_proj", "mlp.experts.gate_up_proj")
METRICS = {"reward", "reward_exact", "kl", "masked_fraction", "flip_rate", "loss",
           "sampler_revision"}  # fmt: skip


@pytest.fixture(scope="module")
def moe_config(
    config: MintConfig, worker: ManagedProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[MintConfig]:
    """The session's registry with a worker of its own serving the tiny MoE base."""
    folder = ensure_tiny(SPEC, tmp_path_factory.mktemp("moe-base"))
    moe = dataclasses.replace(config, base=BaseSource(str(folder)))
    process = start_worker(moe)
    try:
        yield dataclasses.replace(moe, worker_urls=(process.url,))
    finally:
        process.stop()


def test_rl_flow_ships_each_sync_and_continues_from_a_revision(
    moe_config: MintConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flows.rl import rl

    for name, value in moe_config.to_env().items():
        monkeypatch.setenv(name, value)
    report = rl("rl-bot", steps=4, prompts=2, group=4, sync_every=2, max_chars=3)
    assert report.revisions == ("rl-bot:r1", "rl-bot:r2", "rl-bot:r3")

    registry = Registry(moe_config.tracking_uri)
    assert registry.revisions.resolve(RevisionRef("rl-bot", alias="rl")).id == RevisionId(
        "rl-bot", 3
    )
    policies = [registry.revisions.get(RevisionId("rl-bot", number)).policy for number in (1, 2, 3)]
    lineage = [(p.parent_revision, p.training_steps, p.dataset) for p in policies]
    assert lineage == [(None, 0, "rl:reverse"), (1, 2, "rl:reverse"), (2, 4, "rl:reverse")]
    shapes = {(p.lora_rank, p.lora_alpha, p.target_parameters) for p in policies}
    assert shapes == {(8, 16, EXPERTS)}

    client = MlflowClient(moe_config.tracking_uri)
    run = client.get_run(report.run_id)
    assert run.info.status == "FINISHED"
    assert set(run.data.metrics) == METRICS
    sampled_by = client.get_metric_history(report.run_id, "sampler_revision")
    assert [(m.step, m.value) for m in sampled_by] == [(1, 1.0), (2, 1.0), (3, 2.0), (4, 2.0)]
    flips = client.get_metric_history(report.run_id, "flip_rate")
    masked = client.get_metric_history(report.run_id, "masked_fraction")
    assert [m.step for m in flips] == [m.step for m in masked] == [1, 2, 3, 4]
    # The worker's samples, scored with their routes replayed by the trainer holding the same
    # weights at step 1, keep every token (ratios near 1).
    assert masked[0].value == 0.0

    # Starts that are not a revision of this adapter's line are refused before anything runs.
    with pytest.raises(ConfigurationError, match="start='other-bot:r1' is a revision of other-bot"):
        rl("rl-bot", start="other-bot:r1", steps=2)
    with pytest.raises(NotFoundError, match=r"start='rl-bot:r9': rl-bot:r9 does not exist"):
        rl("rl-bot", start="rl-bot:r9", steps=2)
    # So are shapes GRPO cannot run with, and words no toy task has.
    with pytest.raises(ConfigurationError, match="group=1 at least 2"):
        rl("rl-bot", group=1)
    with pytest.raises(ConfigurationError, match="max_chars=2: no toy word is that short"):
        rl("rl-bot", max_chars=2)
    assert [r.id.number for r in registry.revisions.of("rl-bot")] == [1, 2, 3]

    # From r2, at a rank the start overrides, with the policy update on 2 processes (torchrun,
    # a prompt's group each): r4 is r2 again, r5 trained on from it.
    again = rl("rl-bot", start="rl-bot:r2", steps=2, prompts=2, group=4, sync_every=2,
               max_chars=3, rank=2, alpha=2, nproc_per_node=2)  # fmt: skip
    assert again.revisions == ("rl-bot:r4", "rl-bot:r5")
    start, first, last = (registry.revisions.get(RevisionId("rl-bot", n)).policy for n in (2, 4, 5))
    assert (last.trained_with["world_size"], last.trained_with["dist_backend"]) == (2, "gloo")
    assert client.get_run(again.run_id).data.tags["mint.world_size"] == "2"
    assert first.content_digest == start.content_digest
    assert (first.parent_revision, last.parent_revision) == (2, 4)
    assert (last.lora_rank, last.lora_alpha, last.target_parameters) == (8, 16, EXPERTS)
    assert last.content_digest != start.content_digest
    assert registry.revisions.resolve(RevisionRef("rl-bot", alias="rl")).id == RevisionId(
        "rl-bot", 5
    )
    sampled_by = client.get_metric_history(again.run_id, "sampler_revision")
    assert [(m.step, m.value) for m in sampled_by] == [(1, 4.0), (2, 4.0)]
    # Step 1 samples from r4 and trains r2's weights against r2's: no divergence, no mask.
    kl = {m.step: m.value for m in client.get_metric_history(again.run_id, "kl")}
    masked = {m.step: m.value for m in client.get_metric_history(again.run_id, "masked_fraction")}
    assert (kl[1], masked[1]) == (0.0, 0.0)
