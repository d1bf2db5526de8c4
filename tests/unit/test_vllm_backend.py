"""The vLLM backend's pieces that need no running vLLM: how configuration becomes vLLM's command
line (what each MinT tier maps to), and how vLLM's answers become MinT's errors. The backend
itself runs against a real vLLM in `test_backends.py`."""

import asyncio
import dataclasses
import json
import re
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from mint_core.artifacts.packing import FusedExperts, PackedAdapter, PackedIndex, StoredTensor
from mint_core.config import BackendKind, MintConfig
from mint_core.errors import (
    ConfigurationError,
    EngineUnavailableError,
    NotReadyError,
    ServiceError,
)
from mint_core.model.base import BaseIdentity, BaseText
from serving.backends.vllm import VllmBackend, VllmServer, VllmSettings, refuse_expert_lora
from serving.backends.vllm_calls import Calls, events, generation_error


def text(path: Path) -> BaseText:
    identity = BaseIdentity("acme/base-7b", "sha256:" + "d" * 64)
    return BaseText(identity, codec=None, path=path, family="llama", context_length=4096)  # type: ignore[arg-type]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_configuration_maps_onto_vllms_tiers_and_limits(tmp_path: Path) -> None:
    config = MintConfig(
        home=tmp_path,
        backend=BackendKind.VLLM,
        device_slots=8,
        host_adapters=128,
        max_lora_rank=64,
        max_batch=32,
        vllm_python=sys.executable,
        vllm_args=("--tensor-parallel-size", "2"),
    )
    settings = dataclasses.replace(VllmSettings.from_config(config), device="cuda")
    server = VllmServer(settings, text(tmp_path / "base"))
    argv = server.argv()
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert flag(argv, "--model") == str(tmp_path / "base")
    assert flag(argv, "--served-model-name") == "acme/base-7b"
    assert flag(argv, "--host") == "127.0.0.1"
    assert "--api-key" not in argv  # in the environment, out of sight of `ps`
    assert server.env()["VLLM_API_KEY"] == server.api_key and len(server.api_key) >= 32
    assert (flag(argv, "--max-loras"), flag(argv, "--max-cpu-loras")) == ("8", "128")
    assert (flag(argv, "--max-lora-rank"), flag(argv, "--max-num-seqs")) == ("64", "32")
    assert "--enable-lora" in argv and flag(argv, "--dtype") == "auto"
    assert argv[-2:] == ["--tensor-parallel-size", "2"]
    assert "--enforce-eager" not in argv  # CUDA graphs on GPUs
    assert server.env()["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert server.env()["VLLM_HOST_IP"] == "127.0.0.1"
    # Whatever the worker's environment says: unknown names answer 404 (no base in their place,
    # no adapter found by a resolver behind MinT's back).
    assert server.env()["VLLM_SKIP_MODEL_NAME_VALIDATION"] == "0"
    assert server.env()["VLLM_LORA_RESOLVER_CACHE_DIR"] == ""
    assert server.env()["VLLM_LORA_RESOLVER_HF_REPO_LIST"] == ""

    on_cpu = VllmServer(dataclasses.replace(settings, device="cpu"), text(tmp_path)).argv()
    assert flag(on_cpu, "--dtype") == "float32"  # vLLM's auto is bf16 on CPU
    assert "--enforce-eager" in on_cpu and "--kv-cache-memory-bytes" in on_cpu


def test_bad_vllm_configuration_is_refused_naming_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"MINT_MAX_LORA_RANK=12 is not one of"):
        MintConfig.from_env({"MINT_MAX_LORA_RANK": "12"})
    with pytest.raises(ConfigurationError, match=r"MINT_BACKEND='tgi' is not one of embedded"):
        MintConfig.from_env({"MINT_BACKEND": "tgi"})
    assert MintConfig.from_env({"MINT_BACKEND": "VLLM"}).backend is BackendKind.VLLM
    missing = MintConfig(home=tmp_path, vllm_python=str(tmp_path / "nowhere" / "python"))
    with pytest.raises(ConfigurationError, match=r"make vllm"):
        VllmSettings.from_config(missing)
    back = MintConfig.from_env(MintConfig(vllm_args=("--enforce-eager", "--seed", "1")).to_env())
    assert back.vllm_args == ("--enforce-eager", "--seed", "1")


def test_vllms_answers_become_mints_errors() -> None:
    def answer(status: int, message: str) -> tuple[int, bytes]:
        return status, json.dumps({"error": {"message": message, "code": status}}).encode()

    dead = generation_error("bot:r1", *answer(503, "EngineCore encountered an issue"))
    assert isinstance(dead, EngineUnavailableError)
    missing = generation_error("bot:r1", *answer(404, "The model `bot:r1` does not exist."))
    assert isinstance(missing, NotReadyError) and "does not exist" in str(missing)
    refused = generation_error("bot:r1", *answer(400, "max_tokens must be at least 1"))
    assert isinstance(refused, ConfigurationError) and "max_tokens" in str(refused)
    broken = generation_error("bot:r1", 500, b"engine dead")
    assert (
        isinstance(broken, ServiceError) and "500" in str(broken) and "engine dead" in str(broken)
    )


def test_server_sent_events_are_read_up_to_done() -> None:
    lines = [
        b'data: {"a": 1}\n',
        b"\n",
        b": keep-alive\n",
        b'data: {"b": 2}\n',
        b"data: [DONE]\n",
        b'data: {"c": 3}\n',
    ]

    async def read() -> list[dict]:
        async def stream() -> AsyncIterator[bytes]:
            for line in lines:
                yield line

        return [event async for event in events(stream())]

    assert asyncio.run(read()) == [{"a": 1}, {"b": 2}]


def test_an_expert_lora_is_refused_before_it_reaches_vllm() -> None:
    def adapter(config: dict[str, object], tensors: dict[str, StoredTensor]) -> PackedAdapter:
        return PackedAdapter(PackedIndex(config, tensors, (), "sha256:" + "e" * 64), {})

    key = "base_model.model.model.layers.0.mlp.experts.lora_A.weight"
    experts = {key: StoredTensor("shard-00000.safetensors", key, fused=FusedExperts(4, 2))}
    by_config = adapter({"target_parameters": ["mlp.experts.down_proj"]}, {})
    by_tensors = adapter({}, experts)
    backend = VllmBackend.__new__(VllmBackend)  # no vLLM: staging refuses before using it
    for refused, named in ((by_config, "mlp.experts.down_proj"), (by_tensors, key)):
        with pytest.raises(
            ConfigurationError,
            match=rf"vLLM's CPU build serves no expert LoRA: moe-bot:r1 adapts .*{re.escape(named)}"
            r".*; serve it on an embedded worker",
        ):
            backend.stage("moe-bot:r1", refused)
    refuse_expert_lora("dense-bot:r1", adapter({"target_modules": ["q_proj"]}, {}))


def test_closing_fails_every_generation_running_or_sent_after() -> None:
    calls = Calls("http://127.0.0.1:9", "key")
    heard: list[str] = []
    running = threading.Event()

    async def forever() -> None:
        try:
            running.set()
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            heard.append("cancelled while running")
            raise

    calls.start(forever, lambda: heard.append("cancelled before it ran"))
    assert running.wait(10)
    calls.close()
    calls.start(forever, lambda: heard.append("refused after close"))
    calls.close()  # idempotent
    assert heard == ["cancelled while running", "refused after close"]
