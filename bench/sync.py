"""Sync benchmark: from "training finished" to "a running worker answers with it", shipping only
the adapter versus shipping a merged checkpoint (the paper's headline: 18.3x faster on a 4B dense
model).

Set up before any clock starts: a Qwen3-0.6B-shaped base built from config with random weights
(hidden 1024, 28 layers, 16 query and 8 key/value heads of 128, MLP 3072, vocabulary 151,936,
tied embeddings), saved as a model folder with the byte tokenizer (`tiny.save_base_folder`; its
261 tokens are a subset of the vocabulary); a real `mlflow server`; a MinT worker process
serving that base (MINT_BASE_MODEL = the folder), base resident. Each run then has "training
finished": a rank-16 LoRA on every projection (q, k, v, o, gate, up, down) with random non-zero
B, as a PeftModel in memory and a PEFT adapter folder on disk. From there, one after the other:

- adapter path: freeze, pack, export to the local artifact store (under a temporary MINT_HOME),
  register the revision in MLflow, admit it on the running worker, which fetches and prewarms
  it; the clock stops when a `/generate` request naming the revision answers.
- merged path: `merge_and_unload`, `save_pretrained` of the merged model with its tokenizer, a
  fresh worker process with MINT_BASE_MODEL = that folder (its start-up counts: imports, loading
  the weights, hashing them for the base's identity, measured apart as `merged_digest_s`); the
  clock stops when its first `/generate` answers.

The timed requests ask for one token (the first token served is the point); an untimed answer of
8 tokens then checks that the adapter changed the base's answer on both paths. Runs alternate
which path goes first, so drift hits both alike; the figures are medians. Bytes moved are the
exported artifact's files against the merged folder's files. The disk's raw read speed, cold
(pages evicted) and warm, gives each path's floor: its bytes read once at that speed.

Where a CUDA device exists the workers run on it (`--device`) and the run also times one slot
load of the adapter against a pinned copy of as many bytes (`bench/transfer.py`).

float32 by default: what a worker on a CPU runs unless MINT_DTYPE says otherwise. `--dtype
bfloat16` (Qwen3's own) halves the merged bytes; the adapter stays float32, as PEFT trains it.
Prints the figures and writes bench/results/sync.json.

    .venv/bin/python bench/sync.py                      # 28 layers, 5 runs (~4 min)
    .venv/bin/python bench/sync.py --layers 2 --runs 1  # a smoke run
"""

import argparse
import copy
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
# Idle OpenMP threads wait without spinning (set before torch loads; the workers inherit it). It
# changes no arithmetic; on a CPU shared with other work, spinning threads made the freeze
# step's few hundred small tensor checks take seconds instead of a tenth of one.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import httpx
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import PreTrainedModel, Qwen3Config, Qwen3ForCausalLM

from bench import harness, transfer
from bench.harness import Clock
from mint_core.artifacts.freezing import freeze
from mint_core.artifacts.packing import pack
from mint_core.artifacts.stores import open_store
from mint_core.config import MintConfig
from mint_core.model.base import DEFAULT_TARGETS, BaseSource, identity, weights_digest
from mint_core.model.generate import seeded
from mint_core.model.tiny import SPECIAL_TOKENS, byte_tokenizer, save_base_folder
from mint_core.registry import Registry
from mint_core.revisions import PolicyRecord, RevisionId
from processes import ManagedProcess
from serving.http.client import WorkerClient
from serving.worker.server import start_worker

QWEN3_0_6B_LAYERS = 28
RANK, ALPHA = 16, 32
PROMPT = "sync="
CHECK_TOKENS = 8
"""Tokens of the untimed answer compared across the paths and with the base's; the timed
request asks for one: the first token served is the point."""
B_STD = 0.02
"""Spread of the random LoRA B (PEFT starts it at zero, which would change nothing): the
scale of the base's own initialisation, so every answer changes."""


def qwen3_family() -> dict[str, Any]:
    """What Qwen3's config.json files share (context, RoPE, norm), with the byte tokenizer's
    special token ids."""
    tokenizer = byte_tokenizer()
    return {
        "max_position_embeddings": 40_960,
        "rope_theta": 1_000_000.0,
        "rms_norm_eps": 1e-6,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def qwen3_0_6b(layers: int) -> Qwen3Config:
    """Qwen3-0.6B's shape (its config.json), with `layers` decoder layers."""
    return Qwen3Config(
        vocab_size=151_936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        **qwen3_family(),
    )


def build_base(layers: int, dtype: torch.dtype, folder: Path) -> PreTrainedModel:
    with seeded(0):
        model = Qwen3ForCausalLM(qwen3_0_6b(layers)).to(dtype).eval().requires_grad_(False)
    save_base_folder(model, folder)
    return model


def finished(
    base: Callable[[], PreTrainedModel], lora: LoraConfig, seed: int, folder: Path, base_name: str
) -> PeftModel:
    """What training leaves: `lora` on the model `base()` makes, with random non-zero B, as the
    PeftModel in memory and its PEFT adapter folder (naming `base_name`) on disk."""
    with seeded(seed):
        model = get_peft_model(base(), lora)
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.data.normal_(0.0, B_STD)
    model.peft_config["default"].base_model_name_or_path = base_name
    model.save_pretrained(folder, save_embedding_layers=False)
    return model.eval()


def finished_training(base: PreTrainedModel, seed: int, folder: Path) -> PeftModel:
    """A rank-16 LoRA on every projection of (a copy of) `base`."""
    lora = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(DEFAULT_TARGETS))
    return finished(lambda: copy.deepcopy(base), lora, seed, folder, folder.name)


def path_options(parser: argparse.ArgumentParser, runs: int) -> None:
    """The options both sync benchmarks take: the base's dtype and device, how many runs."""
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    transfer.device_option(parser)
    parser.add_argument("--runs", type=int, default=runs, help="runs of each path (medians)")


def answer(url: str, adapter_id: str | None, new_tokens: int = 1) -> tuple[list[int], str]:
    """Greedy `/generate` on `url`: the token ids and the revision that served them."""
    body = {
        "inputs": PROMPT,
        "parameters": {"adapter_id": adapter_id, "max_new_tokens": new_tokens, "details": True},
    }
    response = httpx.post(f"{url}/generate", json=body, timeout=300)
    if response.status_code != 200:
        raise SystemExit(f"{url}/generate answered {response.status_code}: {response.text[:500]}")
    tokens = [token["id"] for token in response.json()["details"]["tokens"]]
    return tokens, response.headers.get("X-Mint-Revision", "")


def adapter_path(
    config: MintConfig, worker: ManagedProcess, adapter_dir: Path, name: str
) -> tuple[Clock, list[int], int]:
    """The adapter path from a PEFT folder to the running worker's first answer with it: the
    clock, the answer's tokens and the exported artifact's bytes."""
    store, registry = open_store(config), Registry(config.tracking_uri)
    client = WorkerClient(worker.url)
    clock = Clock()
    with clock.stage("freeze"):
        frozen = freeze(adapter_dir, config.frozen_root)
    with clock.stage("pack"):
        packed_dir = config.work_root / "packed" / frozen.digest.removeprefix("sha256:")
        index = pack(frozen, packed_dir)
    with clock.stage("export"):
        uri = store.put(packed_dir, index.content_digest)
    with clock.stage("register"):
        base = identity(config.base, config.home)  # its digest is cached: no rehash
        policy = PolicyRecord(
            adapter=name,
            content_digest=index.content_digest,
            base_model_id=base.model_id,
            base_digest=base.digest,
            training_steps=0,
            dataset_digest="",
            lora_rank=frozen.adapter_config["r"],
            lora_alpha=frozen.adapter_config["lora_alpha"],
            target_modules=tuple(sorted(frozen.adapter_config["target_modules"])),
            target_parameters=tuple(frozen.adapter_config.get("target_parameters") or ()),
            created_by="bench",
            created_at=datetime.now(UTC).isoformat(),
            frozen_digest=frozen.digest,
        )
        revision: RevisionId = registry.revisions.register(policy, uri, base.digest).id
    with clock.stage("admit"):
        client.admit(revision)
    with clock.stage("fetch_prewarm"):
        client.wait_ready(revision, timeout_s=300)
    with clock.stage("answer"):
        _, served = answer(worker.url, str(revision))
    client.close()
    if served != str(revision):
        raise SystemExit(f"asked for {revision}, the worker answered with {served!r}")
    tokens, _ = answer(worker.url, str(revision), CHECK_TOKENS)
    artifact = store.fetch(uri)  # the local store's folder: what a worker fetches
    return clock, tokens, folder_bytes(artifact)


def merged_path(
    served: "Served", model: PeftModel, folder: Path, services: list[ManagedProcess]
) -> tuple[Clock, list[int]]:
    """The merged path from the PeftModel in memory to a fresh worker's first answer with the
    merged weights as its base: the clock and the answer's tokens."""
    clock = Clock()
    with clock.stage("merge"):
        merged = model.merge_and_unload()
    with clock.stage("save"):
        save_base_folder(merged, folder)
    with clock.stage("start_load"):
        config = served.config
        on_merged = replace(config, base=replace(config.base, name=str(folder)))
        server = start_worker(on_merged, env=served.readers)
        services.append(server)
    with clock.stage("answer"):
        answer(server.url, None)
    tokens, _ = answer(server.url, None, CHECK_TOKENS)
    server.stop()
    services.remove(server)
    return clock, tokens


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def read_speed(folder: Path, cold: bool) -> float:
    """Bytes per second reading every file of `folder` once, nothing else: from the page cache
    (warm), or with its pages evicted first (cold; in a VM the host may still cache them)."""
    paths = sorted(path for path in folder.rglob("*") if path.is_file())
    if cold:
        os.sync()
        harness.evict(paths)
    buffer = bytearray(64 << 20)
    total = 0
    start = time.perf_counter()
    for path in paths:
        with path.open("rb", buffering=0) as file:
            while count := file.readinto(buffer):
                total += count
    return total / (time.perf_counter() - start)


@dataclass
class SideBySide:
    """The runs of the adapter path and the full path (`full`: "merged" or "full", as the
    benchmark names it), each run a fresh adapter, the paths alternating which goes first."""

    full: str
    clocks: dict[str, list[Clock]]
    bytes: dict[str, int]
    peft_bytes: int
    answers: list[dict[str, Any]]
    full_dir: Path
    """The last run's full folder, kept to measure the disk on."""

    def seconds(self) -> dict[str, float]:
        return {
            path: statistics.median(c.total for c in clocks) for path, clocks in self.clocks.items()
        }

    def stages(self) -> dict[str, dict[str, float]]:
        return {path: harness.median_stages(clocks) for path, clocks in self.clocks.items()}

    def disk_speeds(self) -> tuple[float, float]:
        """Bytes per second reading the last full folder, cold and warm."""
        return read_speed(self.full_dir, cold=True), read_speed(self.full_dir, cold=False)

    def figures(self, served: "Served", cold: float, warm: float) -> dict[str, Any]:
        """The figures both paths give, named after them, with every sample."""
        full, seconds, nbytes = self.full, self.seconds(), self.bytes
        return {
            "adapter_s": seconds["adapter"],
            f"{full}_s": seconds[full],
            "speedup": seconds[full] / seconds["adapter"],
            "adapter_bytes": nbytes["adapter"],
            f"{full}_bytes": nbytes[full],
            "bytes_ratio": nbytes[full] / nbytes["adapter"],
            "runs": len(self.answers),
            "samples_s": {path: [c.total for c in clocks] for path, clocks in self.clocks.items()},
            "stages_s": self.stages(),
            "stage_samples_s": {
                path: [c.stages for c in clocks] for path, clocks in self.clocks.items()
            },
            "base_worker_start_s": served.start_s,
            "disk_read_bytes_per_s": {"cold": cold, "warm": warm},
            "floor_s": {path: nbytes[path] / cold for path in nbytes},
            "base_tokens": served.base_tokens,
            "answers": self.answers,
            "machine": harness.machine() | {"load_average_1m_at_start": served.load_at_start},
        }

    def report(self, cold: float, warm: float, note: str = "") -> None:
        """Print each path's median seconds, bytes and stages, how far above its floor (its
        bytes read once at the disk's `cold` speed) it is, and the speedup (with `note`)."""
        seconds, stages, nbytes, full = self.seconds(), self.stages(), self.bytes, self.full
        for path in self.clocks:
            floor = nbytes[path] / cold
            parts = "  ".join(f"{name} {s:.2f}" for name, s in stages[path].items())
            print(f"  {path:<8} {seconds[path]:7.2f} s  {nbytes[path] / 1e6:9.1f} MB   ({parts})")
            print(f"  {'':<8} floor at the disk's cold read speed: {floor:.3f} s "
                  f"({seconds[path] / floor:.0f}x above it)")  # fmt: skip
        print(f"  speedup {seconds[full] / seconds['adapter']:.2f}x{note}; bytes "
              f"{nbytes[full] / nbytes['adapter']:.1f}x fewer; disk read {cold / 1e9:.2f} GB/s "
              f"cold, {warm / 1e9:.2f} GB/s warm")  # fmt: skip


@dataclass(frozen=True)
class Served:
    """MLflow and a worker serving the base, up before any clock starts."""

    config: MintConfig
    readers: dict[str, str]
    """The environment a worker reads the registry with (the worker's account)."""
    worker: ManagedProcess
    base_tokens: list[int]
    """The base's own answer, which every adapter must change."""
    start_s: float
    load_at_start: float


def serve_base(
    work: Path, folder: Path, dtype: str, services: list[ManagedProcess], device: str = ""
) -> Served:
    """A real `mlflow server` and a worker serving the base in `folder` (on `device`; "": the
    worker's default)."""
    mlflow = harness.start_registry(work / "registry", services)
    source = BaseSource(str(folder), dtype, device)
    config = MintConfig(home=work / "home", tracking_uri=mlflow.url, base=source)
    start = time.perf_counter()
    readers = harness.worker_env(mlflow)
    worker = start_worker(config, env=readers)
    services.append(worker)
    start_s = time.perf_counter() - start
    config = replace(config, worker_urls=(worker.url,))
    base_tokens, _ = answer(worker.url, None, CHECK_TOKENS)
    print(f"worker serving the base up in {start_s:.1f} s", flush=True)
    return Served(config, readers, worker, base_tokens, start_s, os.getloadavg()[0])


def side_by_side(
    served: Served,
    work: Path,
    services: list[ManagedProcess],
    runs: int,
    full: str,
    trained: Callable[[int, Path], PeftModel],
    name: str,
) -> SideBySide:
    """`runs` runs of both paths, each from `trained(seed, folder)`'s adapter (registered as
    `name`-N); `full` names the path that ships the merged weights."""
    clocks: dict[str, list[Clock]] = {"adapter": [], full: []}
    nbytes = {"adapter": 0, full: 0}
    answers: list[dict[str, Any]] = []
    peft_bytes = 0
    full_dir = work
    for number in range(runs):
        adapter_dir = work / "adapters" / f"{name}-{number}"
        full_dir = work / f"{full}-{number}"
        peft_model = trained(number + 1, adapter_dir)
        peft_bytes = folder_bytes(adapter_dir)
        tokens: dict[str, list[int]] = {}
        for path in harness.alternating(number, ("adapter", full)):
            if path == "adapter":
                clock, tokens[path], nbytes[path] = adapter_path(
                    served.config, served.worker, adapter_dir, f"{name}-{number}"
                )
            else:
                clock, tokens[path] = merged_path(served, peft_model, full_dir, services)
                nbytes[path] = folder_bytes(full_dir)
            clocks[path].append(clock)
        del peft_model
        answers.append({"run": number} | tokens)
        print(f"  run {number}: adapter {clocks['adapter'][-1].total:6.2f} s   "
              f"{full} {clocks[full][-1].total:6.2f} s   same answer: "
              f"{tokens['adapter'] == tokens[full]}", flush=True)  # fmt: skip
        if served.base_tokens in tokens.values():
            raise SystemExit(
                f"run {number}: an answer {tokens} equals the base's {served.base_tokens}: the "
                "adapter changed nothing, so the figures would not show it was applied (raise "
                "B_STD)"
            )
        if number + 1 < runs:
            shutil.rmtree(full_dir)  # the last one stays, to measure the disk on
    return SideBySide(full, clocks, nbytes, peft_bytes, answers, full_dir)


def main() -> None:
    parser = harness.command_line(__doc__, "sync")
    parser.add_argument("--layers", type=int, default=QWEN3_0_6B_LAYERS)
    path_options(parser, runs=5)
    args = parser.parse_args()
    with harness.scratch("sync") as (work, services):
        run(args, work, services)


def run(args: argparse.Namespace, work: Path, services: list[ManagedProcess]) -> None:
    base_folder = work / "qwen3-0.6b-shaped"
    start = time.perf_counter()
    base = build_base(args.layers, getattr(torch, args.dtype), base_folder)
    parameters = sum(p.numel() for p in base.parameters())
    print(f"base: Qwen3-0.6B shape, {args.layers} layers, {parameters / 1e6:.0f} M parameters, "
          f"{args.dtype}, {folder_bytes(base_folder) / 1e9:.2f} GB on disk "
          f"(built in {time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
    if args.layers != QWEN3_0_6B_LAYERS:
        print(f"NOTE: {args.layers} layers, not Qwen3-0.6B's {QWEN3_0_6B_LAYERS}")

    served = serve_base(work, base_folder, args.dtype, services, args.device)
    trained = partial(finished_training, base)
    side = side_by_side(served, work, services, args.runs, "merged", trained, "sync")

    cold, warm = side.disk_speeds()
    start = time.perf_counter()  # what the merged worker's start spent naming its new base
    weights_digest(side.full_dir, work / "digest-probe.json")
    merged_digest_s = time.perf_counter() - start
    print(f"\nfrom training finished to a running worker answering ({args.runs} runs, medians):")
    side.report(cold, warm)
    print(f"  of the merged start, hashing the new base's weights: {merged_digest_s:.2f} s")
    # The workers have stopped: on a CUDA device, one slot load of the last adapter against
    # a pinned copy of as many bytes, on an engine over the same base in this process.
    link = transfer.peft_folder_bandwidth(
        served.config.base, served.config.home, work / "adapters" / f"sync-{args.runs - 1}"
    )
    transfer.report(link)

    result = side.figures(served, cold, warm) | {
        "peft_adapter_bytes": side.peft_bytes,
        "model": {
            "shape": "Qwen3-0.6B",
            "layers": args.layers,
            "full_layers": QWEN3_0_6B_LAYERS,
            "parameters": parameters,
            "dtype": args.dtype,
            "vocab_size": base.config.vocab_size,
            "tokenizer_vocab": len(SPECIAL_TOKENS) + 256,
        },
        "adapter": {"rank": RANK, "alpha": ALPHA, "target_modules": list(DEFAULT_TARGETS)},
        "merged_digest_s": merged_digest_s,
        "device": args.device,
        "host_to_device_copy": link,
    }
    harness.write(args.out, result)


if __name__ == "__main__":
    main()
