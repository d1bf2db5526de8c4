"""Batching benchmark: one request set, 64 distinct adapters, served four ways in one run.

(a) base only (the same requests, no adapters): the ceiling; (b) MinT's mixed batches
(gathered per-row LoRA deltas over device slots); (c) PEFT's per-request `set_adapter`
switching, one request at a time (the naive server); (d) PEFT's own mixed batch
(`adapter_names=`). (a) and (b) go through the worker's continuous-batching scheduler, all
requests submitted at once, as a serving worker runs them. Every
request has the same prompt length and generates the same number of tokens (EOS is masked), on
a model large enough that matmuls dominate. Prints tokens/s and ratios (medians of several
runs), checks (b), (c) and (d) give the same tokens, and writes bench/results/batching.json.
Where a CUDA device exists everything runs on it (`--device`), and the run also times one slot
load against a pinned copy of as many bytes (`bench/transfer.py`).

    .venv/bin/python bench/batching.py               # hidden 1024, 4 layers, 64 adapters
    .venv/bin/python bench/batching.py --scale 0.25  # a smoke run
"""

import copy
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model_state_dict, set_peft_model_state_dict
from transformers import LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import harness, transfer
from mint_core.model.base import DEFAULT_TARGETS, BaseIdentity, BaseModel, BaseText
from mint_core.model.generate import greedy_generate, seeded
from mint_core.model.text import TextCodec
from mint_core.model.tiny import TinySpec, byte_tokenizer
from mint_core.model.toy import held_out_words
from mint_core.planning.residency import Residency
from serving.engine.engine import BASE, AdapterWeights, TorchEngine
from serving.engine.sampling import SamplingParams
from serving.engine.scheduler import Scheduler
from serving.metrics import WorkerMetrics


def build_base(scale: float, device: str = "cpu") -> tuple[BaseModel, TinySpec]:
    """A random Llama (no pretraining: only the arithmetic counts here) with the byte
    tokenizer, as the worker would hold it."""
    hidden = max(64, int(1024 * scale) // 16 * 16)
    spec = TinySpec(
        hidden_size=hidden,
        num_layers=4,
        num_heads=16,
        intermediate_size=hidden * 11 // 4,
        pretrain_steps=0,
    )
    with seeded(0):
        model = LlamaForCausalLM(spec.model_config()).eval().requires_grad_(False).to(device)
    codec = TextCodec(byte_tokenizer(), None, spec.name)
    # Never end early: every request generates exactly its --new-tokens in every mode.
    eos = torch.tensor(sorted(codec.eos_ids), device=device)
    model.lm_head.register_forward_hook(lambda _m, _i, logits: logits.index_fill(-1, eos, -1e9))
    identity = BaseIdentity(spec.name, "sha256:bench")
    context = int(model.config.max_position_embeddings)
    text = BaseText(identity, codec, Path("."), str(model.config.model_type), context)
    return BaseModel(model, text), spec


def adapter_states(base: BaseModel, lora: LoraConfig, count: int) -> list[dict[str, torch.Tensor]]:
    """`count` random LoRAs of shape `lora`, as PEFT state dicts."""
    template = get_peft_model_state_dict(PeftModel(copy.deepcopy(base.model), lora))
    states = []
    for number in range(count):
        with seeded(number + 1):
            states.append({key: torch.randn_like(value) * 0.05 for key, value in template.items()})
    return states


def main() -> None:
    parser = harness.command_line(__doc__, "batching")
    parser.add_argument("--scale", type=float, default=1.0, help="scale the model width")
    parser.add_argument("--adapters", type=int, default=64)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=8, help="per request")
    parser.add_argument("--new-tokens", type=int, default=48, help="per request (EOS masked)")
    transfer.device_option(parser)
    args = parser.parse_args()
    torch.set_grad_enabled(False)

    base, spec = build_base(args.scale, args.device)
    params = sum(p.numel() for p in base.model.parameters())
    print(
        f"base: hidden {spec.hidden_size}, {spec.num_layers} layers, "
        f"{params / 1e6:.1f} M parameters; {args.adapters} adapters of rank {args.rank}"
    )
    lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=list(DEFAULT_TARGETS))
    states = adapter_states(base, lora, args.adapters)
    names = [f"adapter-{n:02d}" for n in range(args.adapters)]
    # Every prompt is `--prompt-tokens` long: BOS, then a word repeated and cut, then "=" (the
    # byte tokenizer has one token per byte).
    prompts = [
        base.codec.encode((w * 8)[: args.prompt_tokens - 2] + "=")
        for w in held_out_words(args.adapters)
    ]

    peft = PeftModel(copy.deepcopy(base.model), lora, adapter_name=names[0])
    for name, state in zip(names, states, strict=True):
        if name != names[0]:
            peft.add_adapter(name, lora)
        set_peft_model_state_dict(peft, state, adapter_name=name)
    peft.eval()
    engine = TorchEngine(base, slots=args.adapters)
    config = lora.to_dict() | {"target_modules": sorted(DEFAULT_TARGETS)}
    host = {
        name: engine.prepare(name, config, state) for name, state in zip(names, states, strict=True)
    }
    link = transfer.slot_load_bandwidth(engine, host[names[0]])  # before the scheduler loads any
    transfer.report(link)
    residency: Residency[AdapterWeights] = Residency(
        sum(w.nbytes for w in host.values()), device_slots=args.adapters
    )
    for weights in host.values():
        residency.put_host(weights.key, weights, weights.nbytes)
    scheduler = Scheduler(engine, residency, WorkerMetrics(residency), max_batch=len(prompts))
    sampling = SamplingParams(max_new_tokens=args.new_tokens)

    def mint(keys: list[str]) -> list[tuple[int, ...]]:
        requests = [
            scheduler.submit(prompt, key, sampling)
            for prompt, key in zip(prompts, keys, strict=True)
        ]
        return [request.result().token_ids for request in requests]

    def peft_switching() -> list[tuple[int, ...]]:
        tokens = []
        for name, prompt in zip(names, prompts, strict=True):
            peft.set_adapter(name)
            generation = greedy_generate(peft, base.codec, [prompt], args.new_tokens)[0]
            tokens.append(generation.token_ids)
        return tokens

    def peft_mixed() -> list[tuple[int, ...]]:
        generations = greedy_generate(
            peft, base.codec, prompts, args.new_tokens, adapter_names=names
        )
        return [g.token_ids for g in generations]

    modes: dict[str, Callable[[], list[tuple[int, ...]]]] = {
        "base": lambda: mint([BASE] * len(prompts)),
        "mixed": lambda: mint(names),
        "peft_switching": peft_switching,
        "peft_mixed": peft_mixed,
    }
    outputs = {name: run() for name, run in modes.items()}  # warm-up, and answers to compare
    samples = harness.interleaved(modes, args.runs)
    tokens = len(prompts) * args.new_tokens
    assert all(len(t) == args.new_tokens for t in outputs["mixed"])
    same = {name: outputs[name] == outputs["mixed"] for name in ("peft_switching", "peft_mixed")}
    per_s = {name: tokens / statistics.median(times) for name, times in samples.items()}
    for name, rate in per_s.items():
        median = statistics.median(samples[name])
        print(f"  {name:<15} {rate:9.1f} tokens/s  ({median:.2f} s for {tokens} tokens)")
    ratios = {
        "mixed_over_base": per_s["mixed"] / per_s["base"],
        "mixed_over_peft_switching": per_s["mixed"] / per_s["peft_switching"],
        "mixed_over_peft_mixed": per_s["mixed"] / per_s["peft_mixed"],
    }
    for name, value in ratios.items():
        print(f"  {name:<26} {value:6.2f}x")
    print(f"  same tokens as MinT mixed: {same}")
    result = {
        "model": {"hidden": spec.hidden_size, "layers": spec.num_layers},
        "parameters": params,
        "adapters": args.adapters,
        "rank": args.rank,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "runs": args.runs,
        "threads": torch.get_num_threads(),
        "device": str(engine.device),
        "host_to_device_copy": link,
        "tokens_per_s": per_s,
        "samples_s": samples,
        "same_tokens": same,
        **ratios,
    }
    harness.write(args.out, result)
    scheduler.stop()


if __name__ == "__main__":
    main()
