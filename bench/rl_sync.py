"""RL sync benchmark: what one policy sync costs when the trainer ships its LoRA (attention and
every expert) to the sampling worker, against shipping the full merged weights of the same MoE
base (the reference reports 2.85x on a 30B MoE).

The base is Qwen3-30B-A3B's shape (`moe_reference.QWEN3_30B_A3B`: hidden 2048, 32 query and 4
key/value heads of 128, experts of 768, vocabulary 151,936, untied embeddings) with fewer layers
and experts so that it fits this machine (the same share of experts, 8 of 128, routes each
token), random weights, saved with the byte tokenizer. The adapter is what an RL step leaves: a
LoRA of `--rank` (1 by default, as RL needs) on q/k/v/o and, through PEFT's
`target_parameters`, on the fused `mlp.experts.gate_up_proj` and `mlp.experts.down_proj` of
every layer, with random non-zero B.

Each run times both paths with `bench/sync.py`'s own functions, side by side, alternating which
goes first: the adapter path (freeze, pack, export, register in a real MLflow, admit, the
running worker's fetch and prewarm, its first answer) and the full path (`merge_and_unload`,
save, a fresh worker loading the whole model, its first answer). Figures are medians; the
disk's raw read speed gives each path's floor (its bytes read once at the cold speed). Prints
the ratio and writes bench/results/rl_sync.json.

    .venv/bin/python bench/rl_sync.py                      # 3 layers x 8 experts, 3 runs
    .venv/bin/python bench/rl_sync.py --layers 1 --experts 4 --vocab 4096 --runs 1  # smoke
"""

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench/sync.py

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from bench.sync import (
    B_STD,
    CHECK_TOKENS,
    Clock,
    adapter_path,
    answer,
    folder_bytes,
    machine,
    median_stages,
    merged_path,
    read_speed,
)
from control.services import ManagedProcess, start_mlflow, stop_all
from mint_core.config import MintConfig
from mint_core.model.base import BaseSource
from mint_core.model.experts import EXPERT_PARAMETERS
from mint_core.model.generate import seeded
from mint_core.model.tiny import byte_tokenizer, save_base_folder
from mint_core.moe_reference import ATTENTION_PROJECTIONS, QWEN3_30B_A3B, MoeLoraShape
from serving.worker.server import start_worker

RESULTS = Path(__file__).resolve().parent / "results" / "rl_sync.json"
REFERENCE_SPEEDUP = 2.85
"""The reference's adapter sync over full-weight sync on a 30B MoE."""
DEFAULT_SHAPE = QWEN3_30B_A3B.scaled(1 / 16)
"""3 layers of 8 experts: about 0.8 B parameters, 3.2 GB in float32."""
VOCAB = 151_936
EXPERTS_PER_TOKEN_SHARE = 8 / 128
"""Qwen3-30B-A3B routes each token to 8 of its 128 experts."""
EXPERT_TARGETS = [f"mlp.experts.{parameter}" for parameter in EXPERT_PARAMETERS]


def moe_config(shape: MoeLoraShape, vocab: int) -> Qwen3MoeConfig:
    """Qwen3-30B-A3B's config.json with `shape`'s layers and experts and `vocab` tokens."""
    tokenizer = byte_tokenizer()
    return Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=shape.hidden,
        moe_intermediate_size=shape.expert_intermediate,
        num_experts=shape.experts,
        num_experts_per_tok=max(1, round(shape.experts * EXPERTS_PER_TOKEN_SHARE)),
        norm_topk_prob=True,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.query_heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=40_960,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def build_base(shape: MoeLoraShape, vocab: int, dtype: torch.dtype, folder: Path) -> int:
    """Save the random base to `folder`; its parameter count."""
    with seeded(0):
        model = Qwen3MoeForCausalLM(moe_config(shape, vocab)).to(dtype).eval()
    save_base_folder(model, folder)
    return sum(p.numel() for p in model.parameters())


def load(folder: Path, dtype: torch.dtype) -> Qwen3MoeForCausalLM:
    # Loaded per run rather than copied: this process then holds one model, not two.
    return Qwen3MoeForCausalLM.from_pretrained(
        folder, dtype=dtype, local_files_only=True, experts_implementation="eager"
    ).requires_grad_(False)


def finished_step(
    base_folder: Path, dtype: torch.dtype, rank: int, seed: int, folder: Path
) -> PeftModel:
    """What an RL step leaves: the PeftModel in memory and its PEFT adapter folder on disk."""
    lora = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=list(ATTENTION_PROJECTIONS),
        target_parameters=EXPERT_TARGETS,
    )
    with seeded(seed):
        model = get_peft_model(load(base_folder, dtype), lora)
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.data.normal_(0.0, B_STD)
    model.peft_config["default"].base_model_name_or_path = base_folder.name
    model.save_pretrained(folder, save_embedding_layers=False)
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=DEFAULT_SHAPE.layers)
    parser.add_argument("--experts", type=int, default=DEFAULT_SHAPE.experts)
    parser.add_argument("--rank", type=int, default=DEFAULT_SHAPE.rank)
    parser.add_argument(
        "--vocab", type=int, default=VOCAB, help="smaller only for smoke runs: Qwen3's is "
        f"{VOCAB:,} (the byte tokenizer uses its first 261)",
    )  # fmt: skip
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--runs", type=int, default=3, help="runs of each path (medians)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="mint-bench-rl-sync-"))
    services: list[ManagedProcess] = []
    try:
        run(args, work, services)
    finally:
        stop_all(services)
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path, services: list[ManagedProcess]) -> None:
    shape = replace(QWEN3_30B_A3B, layers=args.layers, experts=args.experts, rank=args.rank)
    dtype = getattr(torch, args.dtype)
    base_folder = work / "qwen3-30b-a3b-shaped"
    start = time.perf_counter()
    parameters = build_base(shape, args.vocab, dtype, base_folder)
    print(f"base: Qwen3-30B-A3B shape, {shape.layers} of {QWEN3_30B_A3B.layers} layers, "
          f"{shape.experts} of {QWEN3_30B_A3B.experts} experts, {parameters / 1e6:.0f} M "
          f"parameters, {args.dtype}, {folder_bytes(base_folder) / 1e9:.2f} GB on disk "
          f"(built in {time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip

    mlflow = start_mlflow(work / "registry")
    services.append(mlflow)
    config = MintConfig(
        home=work / "home", tracking_uri=mlflow.url, base=BaseSource(str(base_folder), args.dtype)
    )
    start = time.perf_counter()
    worker = start_worker(config)
    services.append(worker)
    base_worker_start_s = time.perf_counter() - start
    config = replace(config, worker_urls=(worker.url,))
    base_tokens, _ = answer(worker.url, None, CHECK_TOKENS)
    print(f"worker serving the base up in {base_worker_start_s:.1f} s", flush=True)
    load_at_start = os.getloadavg()[0]

    clocks: dict[str, list[Clock]] = {"adapter": [], "full": []}
    answers: list[dict[str, Any]] = []
    adapter_bytes = full_bytes = 0
    for number in range(args.runs):
        adapter_dir = work / "adapters" / f"step-{number}"
        full_dir = work / f"full-{number}"
        peft_model = finished_step(base_folder, dtype, args.rank, number + 1, adapter_dir)
        tokens: dict[str, list[int]] = {}
        for path in ("adapter", "full") if number % 2 == 0 else ("full", "adapter"):
            if path == "adapter":
                clock, tokens[path], adapter_bytes = adapter_path(
                    config, worker, adapter_dir, f"rl-{number}"
                )
            else:
                clock, tokens[path] = merged_path(config, peft_model, full_dir, services)
                full_bytes = folder_bytes(full_dir)
            clocks[path].append(clock)
        del peft_model
        answers.append({"run": number} | tokens)
        print(f"  run {number}: adapter {clocks['adapter'][-1].total:6.2f} s   "
              f"full {clocks['full'][-1].total:6.2f} s   same answer: "
              f"{tokens['adapter'] == tokens['full']}", flush=True)  # fmt: skip
        if base_tokens in tokens.values():
            raise SystemExit(
                f"run {number}: an answer {tokens} equals the base's {base_tokens}: the adapter "
                "changed nothing, so the figures would not show it was applied"
            )
        if number + 1 < args.runs:
            shutil.rmtree(full_dir)  # the last one stays, to measure the disk on

    cold, warm = read_speed(full_dir, cold=True), read_speed(full_dir, cold=False)
    seconds = {path: statistics.median(c.total for c in clocks[path]) for path in clocks}
    nbytes = {"adapter": adapter_bytes, "full": full_bytes}
    floor = {path: nbytes[path] / cold for path in clocks}
    stages = {path: median_stages(clocks[path]) for path in clocks}
    speedup = seconds["full"] / seconds["adapter"]
    print(f"\none RL sync, from the step's weights to the sampling worker answering with them "
          f"({args.runs} runs, medians):")  # fmt: skip
    for path in clocks:
        parts = "  ".join(f"{name} {s:.2f}" for name, s in stages[path].items())
        print(f"  {path:<8} {seconds[path]:7.2f} s  {nbytes[path] / 1e6:9.1f} MB   ({parts})")
        print(f"  {'':<8} floor at the disk's cold read speed: {floor[path]:.3f} s "
              f"({seconds[path] / floor[path]:.0f}x above it)")  # fmt: skip
    print(f"  speedup {speedup:.2f}x (reference: {REFERENCE_SPEEDUP}x on a 30B MoE); bytes "
          f"{full_bytes / adapter_bytes:.1f}x fewer; disk read {cold / 1e9:.2f} GB/s cold, "
          f"{warm / 1e9:.2f} GB/s warm")  # fmt: skip

    result = {
        "adapter_s": seconds["adapter"],
        "full_s": seconds["full"],
        "speedup": speedup,
        "reference_speedup": REFERENCE_SPEEDUP,
        "adapter_bytes": adapter_bytes,
        "full_bytes": full_bytes,
        "bytes_ratio": full_bytes / adapter_bytes,
        "runs": args.runs,
        "samples_s": {path: [c.total for c in clocks[path]] for path in clocks},
        "stages_s": stages,
        "stage_samples_s": {path: [c.stages for c in clocks[path]] for path in clocks},
        "shape": dataclasses.asdict(shape)
        | {
            "dtype": args.dtype,
            "lora_dtype": "float32",  # PEFT trains the adapter in float32 whatever the base
            "vocab_size": args.vocab,
            "experts_per_token": moe_config(shape, args.vocab).num_experts_per_tok,
            "parameters": parameters,
            "full_layers": QWEN3_30B_A3B.layers,
            "full_experts": QWEN3_30B_A3B.experts,
        },
        "adapter": {
            "rank": args.rank,
            "alpha": 2 * args.rank,
            "target_modules": list(ATTENTION_PROJECTIONS),
            "target_parameters": EXPERT_TARGETS,
        },
        "base_worker_start_s": base_worker_start_s,
        "disk_read_bytes_per_s": {"cold": cold, "warm": warm},
        "floor_s": floor,
        "over_floor": {path: seconds[path] / floor[path] for path in clocks},
        "base_tokens": base_tokens,
        "answers": answers,
        "machine": machine() | {"load_average_1m_at_start": load_at_start},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
