"""RL sync benchmark: what one policy sync costs when the trainer ships its LoRA (attention and
every expert) to the sampling worker, against shipping the full merged weights of the same MoE
base (the reference reports 2.85x on a 30B MoE).

The base is Qwen3-30B-A3B's shape (`bench.synthetic.QWEN3_30B_A3B`: hidden 2048, 32 query and 4
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
import os
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench/sync.py

import torch
from peft import LoraConfig, PeftModel
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from bench import harness
from bench.sync import (
    finished,
    folder_bytes,
    path_options,
    qwen3_family,
    serve_base,
    side_by_side,
)
from bench.synthetic import ATTENTION_PROJECTIONS, QWEN3_30B_A3B, MoeLoraShape
from mint_core.model.experts import EXPERT_PARAMETERS
from mint_core.model.generate import seeded
from mint_core.model.tiny import save_base_folder
from processes import ManagedProcess

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
        tie_word_embeddings=False,
        **qwen3_family(),
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
    """What an RL step leaves: a LoRA of `rank` on attention and on every expert."""
    lora = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=list(ATTENTION_PROJECTIONS),
        target_parameters=EXPERT_TARGETS,
    )
    return finished(lambda: load(base_folder, dtype), lora, seed, folder, base_folder.name)


def main() -> None:
    parser = harness.command_line(__doc__, "rl_sync")
    parser.add_argument("--layers", type=int, default=DEFAULT_SHAPE.layers)
    parser.add_argument("--experts", type=int, default=DEFAULT_SHAPE.experts)
    parser.add_argument("--rank", type=int, default=DEFAULT_SHAPE.rank)
    parser.add_argument(
        "--vocab", type=int, default=VOCAB, help="smaller only for smoke runs: Qwen3's is "
        f"{VOCAB:,} (the byte tokenizer uses its first 261)",
    )  # fmt: skip
    path_options(parser, runs=3)
    args = parser.parse_args()
    with harness.scratch("rl-sync") as (work, services):
        run(args, work, services)


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

    served = serve_base(work, base_folder, args.dtype, services, args.device)
    trained = partial(finished_step, base_folder, dtype, args.rank)
    side = side_by_side(served, work, services, args.runs, "full", trained, "rl")

    cold, warm = side.disk_speeds()
    print(f"\none RL sync, from the step's weights to the sampling worker answering with them "
          f"({args.runs} runs, medians):")  # fmt: skip
    side.report(cold, warm, f" (reference: {REFERENCE_SPEEDUP}x on a 30B MoE)")

    result = side.figures(served, cold, warm)
    result |= {
        "reference_speedup": REFERENCE_SPEEDUP,
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
        "over_floor": {path: result[f"{path}_s"] / result["floor_s"][path] for path in side.bytes},
    }
    harness.write(args.out, result)


if __name__ == "__main__":
    main()
