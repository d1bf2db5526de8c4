"""vLLM as a `Backend`: a vLLM OpenAI server that the worker starts on loopback, supervises and
drives, while the worker stays the gate in front of it.

vLLM does what it is good at (paged attention, kernels, tensor parallelism); MinT keeps what
vLLM lacks: revisions, the readiness gate, admission, access. So staging writes each verified
adapter as a PEFT folder of its own, prewarm loads it under its exact revision name (`name:rN`)
through vLLM's runtime LoRA endpoints, eviction unloads it, and a generation is a streamed
completion over the base's token ids that MinT tokenized and ends by its own rules; a
supervisor thread starts vLLM again when it dies. How each tier and step maps onto vLLM's
settings and endpoints, and what it does on failure: the README, "MinT in front of vLLM".
"""

import asyncio
import contextlib
import logging
import secrets
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
import orjson

from mint_core.access import ANONYMOUS
from mint_core.artifacts.folders import publish_folder
from mint_core.artifacts.packing import PackedAdapter, write_peft
from mint_core.config import LOOPBACK, BackendKind, MintConfig
from mint_core.errors import (
    ConfigurationError,
    EngineUnavailableError,
    MintError,
    ServiceError,
)
from mint_core.model.base import BaseText
from mint_core.planning.residency import Residency
from mint_core.tenancy import FairQueue
from processes import ManagedProcess, free_port, responds_ok, start_process
from serving.backends.vllm_calls import Calls, choice_of, error_message, events, generation_error
from serving.engine.engine import BASE
from serving.engine.generation import Generating, check_prompt
from serving.engine.sampling import SamplingParams
from serving.metrics import WorkerMetrics

log = logging.getLogger(__name__)

VLLM_ENV = Path(__file__).resolve().parents[2] / ".venv-vllm"
"""Where `make vllm` builds vLLM's environment."""
START_TIMEOUT_S = 900.0
"""vLLM imports for a minute or more on a busy CPU machine, and compiles on a GPU."""
CHECK_INTERVAL_S = 1.0
FAILED_CHECKS = 10
"""Health checks in a row that must fail before a running vLLM counts as hung and restarts
(each waits up to 2 s: a vLLM busy with a full batch on a small CPU answers slowly, and a
restart costs every generation in flight)."""
BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)
"""Waits before each try to start vLLM again, the last repeated."""
CPU_KV_CACHE = "256M"
"""KV cache on CPU machines (vLLM's default takes a fraction of host memory)."""
CONTROL_TIMEOUT_S = 120.0
"""Loading an adapter, or anything but a generation, answers within this."""


@dataclass(frozen=True)
class VllmSettings:
    """How the worker starts vLLM."""

    python: Path
    home: Path
    """MinT's state dir: vLLM's log goes to `logs/`, staged adapters under `vllm/`."""
    device_slots: int
    host_adapters: int
    max_lora_rank: int
    max_batch: int
    dtype: str
    device: str
    extra_args: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, config: MintConfig) -> "VllmSettings":
        python = Path(config.vllm_python or VLLM_ENV / "bin" / "python")
        if not python.exists():
            raise ConfigurationError(
                f"MINT_BACKEND={BackendKind.VLLM} needs vLLM's Python, and {python} does not "
                "exist: build it with `make vllm`, or point MINT_VLLM_PYTHON at the python of "
                "an environment with vLLM installed"
            )
        return cls(
            python=python,
            home=config.home,
            device_slots=config.device_slots,
            host_adapters=config.host_adapters,
            max_lora_rank=config.max_lora_rank,
            max_batch=config.max_batch,
            dtype=config.base.dtype,
            device=config.base.device,
            extra_args=config.vllm_args,
        )

    @property
    def on_cpu(self) -> bool:
        if self.device:
            return self.device == "cpu"
        import torch

        return not torch.cuda.is_available()


class VllmServer:
    """The vLLM OpenAI server process: its command line and its key."""

    def __init__(self, settings: VllmSettings, text: BaseText) -> None:
        self.settings = settings
        self.text = text
        self.api_key = secrets.token_urlsafe(24)
        """vLLM answers only the worker: every call carries this key."""
        self.port = free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        self.sockets = Path(tempfile.gettempdir()) / f"mint-vllm-{secrets.token_hex(6)}"
        """Where vLLM's processes make their ZMQ sockets (VLLM_RPC_BASE_PATH): by default in
        /tmp itself, where each vLLM stopped or killed (a crash, a restart, a worker stopping
        it) left them for good. Not under MINT_HOME: a socket's path has room for 107 bytes,
        which a user's home need not leave. (Not vLLM's whole TMPDIR: torch's compile cache is
        there, which a restart reuses.) `start` makes it afresh; `remove` removes it."""

    def argv(self) -> list[str]:
        s = self.settings
        dtype = s.dtype or ("float32" if s.on_cpu else "auto")  # auto means bf16 on CPU
        argv = [
            str(s.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.text.path),
            "--served-model-name", self.text.model_id,
            "--host", LOOPBACK, "--port", str(self.port),
            "--dtype", dtype,
            "--enable-lora",
            "--max-loras", str(s.device_slots),
            "--max-cpu-loras", str(max(s.host_adapters, s.device_slots)),
            "--max-lora-rank", str(s.max_lora_rank),
            "--max-num-seqs", str(s.max_batch),
            # Requests wait in the order of the priority MinT gives them: its fair share.
            "--scheduling-policy", "priority",
            # The model's sampling defaults would change requests that leave a knob unset:
            # MinT's requests mean the same on either backend.
            "--generation-config", "vllm",
            "--uvicorn-log-level", "warning",
            "--disable-uvicorn-access-log",
        ]  # fmt: skip
        if s.on_cpu:
            argv += ["--enforce-eager", "--kv-cache-memory-bytes", CPU_KV_CACHE]
        return argv + list(s.extra_args)

    def env(self) -> dict[str, str]:
        env = {
            # In the environment, not argv: other users can read a command line, and a key that
            # starts with "-" would be taken for an option by argparse.
            "VLLM_API_KEY": self.api_key,
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
            # Whatever the worker's environment says: a name vLLM was not told to load must
            # answer 404, never the base (name validation skipped) nor an adapter that a
            # resolver found on disk or on the hub without MinT's checks.
            "VLLM_SKIP_MODEL_NAME_VALIDATION": "0",
            "VLLM_LORA_RESOLVER_CACHE_DIR": "",
            "VLLM_LORA_RESOLVER_HF_REPO_LIST": "",
            "HF_HUB_OFFLINE": "1",
            "VLLM_HOST_IP": LOOPBACK,  # else its processes talk over a non-loopback address
            "VLLM_RPC_BASE_PATH": str(self.sockets),
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        if self.settings.on_cpu:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        return env

    def start(self) -> ManagedProcess:
        """Start vLLM, once the sockets a vLLM before it left (killed) are removed."""
        self.remove()
        self.sockets.mkdir(mode=0o700)
        try:
            return start_process(
                "vLLM",
                self.argv(),
                self.url,
                "/health",
                self.settings.home / "logs" / f"vllm-{self.port}.log",
                self.env(),
                START_TIMEOUT_S,
                # Started from the worker's main thread, or its supervisor thread when
                # restarted: both live as long as the worker.
                die_with_parent=True,
            )
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        """Remove the sockets' folder (vLLM stopped)."""
        shutil.rmtree(self.sockets, ignore_errors=True)


def refuse_expert_lora(key: str, adapter: PackedAdapter) -> None:
    """ConfigurationError if `adapter` adapts fused MoE experts (PEFT's `target_parameters`),
    before anything is written for vLLM: the CPU build MinT runs serves no LoRA on experts, and
    the worker's prewarm then reports the revision FAILED with this reason."""
    parameters = adapter.index.adapter_config.get("target_parameters")
    fused = sorted(t.key for t in adapter.index.tensors.values() if t.fused is not None)
    if parameters or fused:
        raise ConfigurationError(
            f"vLLM's CPU build serves no expert LoRA: {key} adapts the fused expert parameters "
            f"{parameters or fused[:2]}; serve it on an embedded worker (MINT_BACKEND=embedded)"
        )


class VllmBackend:
    kind = BackendKind.VLLM.value

    def __init__(
        self,
        text: BaseText,
        settings: VllmSettings,
        host_cache_bytes: int,
        weight: Callable[[str], float] = lambda _: 1.0,
    ) -> None:
        """`weight`: each principal's fair share of a busy vLLM (`mint_core.tenancy`)."""
        self.text = text
        self.residency: Residency[Path] = Residency(
            host_cache_bytes, settings.device_slots, settings.host_adapters
        )
        self.metrics = WorkerMetrics(self.residency)
        self._server = VllmServer(settings, text)
        self._adapters = settings.home / "vllm" / f"adapters-{self._server.port}"
        self._process = self._server.start()
        self._client = httpx.Client(
            base_url=self._server.url,
            headers={"Authorization": f"Bearer {self._server.api_key}"},
            timeout=httpx.Timeout(CONTROL_TIMEOUT_S, connect=5.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        self._problem: str | None = None
        self._lost: list[Callable[[int], None]] = []
        self._running = 0
        """Generations talking to vLLM (only the loop thread of `_calls` writes it)."""
        self._fair: FairQueue[Generating] = FairQueue(weight)
        """Generations sent to vLLM that have no token yet, tagged in fair-share order: vLLM
        takes each tag as its request's priority, so its waiting requests start in that order.
        A generation leaves at its first token (vLLM started it) or its end."""
        self._fair_lock = threading.Lock()
        self._closed = threading.Event()
        self._calls = Calls(self._server.url, self._server.api_key)
        self.generation = 0
        """Which vLLM runs now: 0 for the first, one more at each restart."""
        self._supervisor = threading.Thread(target=self._supervise, name="vllm", daemon=True)
        self._supervisor.start()
        log.info("vLLM serves %s at %s", text.model_id, self._server.url)

    # Lifecycle.

    def stage(self, key: str, adapter: PackedAdapter) -> list[str]:
        refuse_expert_lora(key, adapter)
        digest = adapter.index.content_digest.removeprefix("sha256:")
        folder = self._adapters / digest
        if not folder.is_dir():
            with publish_folder(folder, ".staging-") as staging:
                write_peft(adapter, staging)
        nbytes = sum(t.nbytes for t in adapter.tensors.values())
        return self.residency.put_host(key, folder, nbytes)

    def load(self, key: str) -> None:
        path = self.residency.host_weights(key)
        body = {"lora_name": key, "lora_path": str(path.absolute())}
        response = self._control("/v1/load_lora_adapter", body)
        if response.status_code == 200:
            return
        message = error_message(response.status_code, response.content)
        if response.status_code == 400 and "already been loaded" in message:
            return  # a revision is immutable: the name loaded is these weights
        self._check_alive(f"loading {key}: {message}")
        raise ConfigurationError(f"vLLM refused to load {key}: {message}")

    def _check_alive(self, doing: str) -> None:
        """EngineUnavailableError if vLLM's engine is dead: vLLM answers 500 to whatever
        failed then (a load included) for a few seconds, until its own watchdog stops it, and
        that is not the request's or the adapter's fault."""
        if self._problem is not None or not responds_ok(self._server.url + "/health"):
            raise EngineUnavailableError(f"vLLM's engine is down ({doing})")

    def unload(self, key: str) -> None:
        if self.residency.leave(key) or not self.residency.in_host(key):
            self._unload(key)

    def _unload(self, key: str) -> None:
        if self._problem is None:
            # A vLLM that went away meanwhile holds nothing once it is back.
            with contextlib.suppress(EngineUnavailableError):
                self._control("/v1/unload_lora_adapter", {"lora_name": key})

    def _control(self, path: str, body: dict[str, object]) -> httpx.Response:
        try:
            return self._client.post(path, json=body)
        except httpx.TransportError as e:
            raise EngineUnavailableError(f"vLLM did not answer {path}: {e}") from e

    # Generation.

    def submit(
        self,
        prompt_ids: Sequence[int],
        key: str,
        params: SamplingParams,
        warm_up: bool = False,
        streamed: bool = True,
        principal: str = ANONYMOUS,
    ) -> Generating:
        if params.return_routes:
            raise ConfigurationError(
                "return_routes: routes are not on vllm (this worker's backend does not report "
                "the experts it routed each token to); sample from an embedded worker"
            )
        check_prompt(self.text, prompt_ids, params)
        if (problem := self._problem) is not None:
            raise EngineUnavailableError(problem)
        request = Generating(list(prompt_ids), key, params, self.text.codec, warm_up, principal)
        with self._fair_lock:
            start = self._fair.push(request, principal, len(prompt_ids) + params.max_new_tokens)
        # vLLM's server writes an event per token, which costs it more than the token: ask for
        # the whole answer at once when nobody reads the tokens as they come, unless a stop
        # string may end the generation early (vLLM is not told MinT's stop strings: the
        # stream is closed where MinT's rules end it).
        stream = streamed or bool(params.stop)
        closed = EngineUnavailableError("the worker is closing; send the request again")
        priority = int(start)  # vLLM's priorities are whole numbers; ties go in arrival order
        self._calls.start(
            lambda: self._run(request, stream, priority), lambda: request.fail(closed)
        )
        return request

    def _payload(self, request: Generating, stream: bool, priority: int) -> dict[str, object]:
        params = request.params
        payload: dict[str, object] = {
            "model": self.text.model_id if request.key == BASE else request.key,
            "prompt": request.prompt_ids,
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "stop_token_ids": sorted(self.text.codec.eos_ids),
            "skip_special_tokens": False,
            "logprobs": 0,
            "return_token_ids": True,
            "stream": stream,
            "priority": priority,
        }
        if not params.greedy:
            payload["seed"] = request.sampler.seed
            if params.top_p is not None:
                payload["top_p"] = params.top_p
            if params.top_k is not None:
                payload["top_k"] = params.top_k
        return payload

    async def _run(self, request: Generating, stream: bool, priority: int) -> None:
        """Generate `request` through vLLM into its events (on the loop of `_calls`)."""
        self._running += 1
        held = False
        try:
            if request.key != BASE:  # held while it runs: never evicted (unloaded) under it
                self.residency.hold(request.key, use=not request.warm_up)
                held = True
            if not request.done:  # else cancelled while it waited: vLLM never hears of it
                await self._generate(request, stream, priority)
        except (aiohttp.ClientError, TimeoutError) as e:
            request.fail(EngineUnavailableError(f"vLLM stopped answering: {e}"))
        except asyncio.CancelledError:  # the worker closes
            request.fail(EngineUnavailableError("the worker is closing; send the request again"))
            raise
        except MintError as e:
            request.fail(e)
        except Exception as e:  # the client must hear of any failure, not wait forever
            log.exception("generation for %s failed", request.key)
            request.fail(ServiceError(f"generation through vLLM failed: {type(e).__name__}: {e}"))
        finally:
            self._running -= 1
            with self._fair_lock:
                self._fair.drop(request)
            if held and self.residency.unhold(request.key):
                # It was asked to leave while this ran: unloading blocks, the loop must not.
                await asyncio.to_thread(self._unload, request.key)

    async def _generate(self, request: Generating, stream: bool, priority: int) -> None:
        payload = self._payload(request, stream, priority)
        async with await self._calls.post("/v1/completions", payload) as (response):
            if response.status != 200:
                body = await response.read()
                if response.status >= 500:
                    await asyncio.to_thread(self._check_alive, f"generating for {request.key}")
                raise generation_error(request.key, response.status, body)
            if stream:
                async for chunk in events(response.content):
                    if self._took(request, choice_of(request.key, chunk)):
                        return  # a client gone: closing the stream aborts it in vLLM
            else:
                answer = orjson.loads(await response.read())
                if self._took(request, choice_of(request.key, answer)):
                    return
        if not request.done:
            raise ServiceError(
                f"vLLM ended the generation for {request.key} after {len(request.token_ids)} "
                "tokens without an end-of-sequence token, stop string or length limit"
            )

    def _took(self, request: Generating, choice: dict) -> bool:
        """Push a choice's tokens into `request`; True once it needs no more."""
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
        if not request.token_ids and logprobs:
            self.metrics.first_token(request)
            with self._fair_lock:
                self._fair.take(request)  # vLLM started it: the fair line moves on
        took = 0  # counted once per choice: a Prometheus counter takes a lock per call
        try:
            for token, logprob in zip(choice["token_ids"], logprobs, strict=True):
                took += 1
                if request.push(token, float(logprob)):
                    self.metrics.finished(request)
                    return True
            return request.done
        finally:
            self.metrics.generated_tokens.inc(took)

    # Health.

    def problem(self) -> str | None:
        return self._problem

    def on_lost(self, callback: Callable[[int], None]) -> None:
        self._lost.append(callback)

    def _supervise(self) -> None:
        failed_checks = 0
        while not self._closed.wait(CHECK_INTERVAL_S):
            process = self._process
            code = process.process.poll()
            if code is None:
                failed_checks = 0 if responds_ok(process.url + "/health") else failed_checks + 1
                if failed_checks < FAILED_CHECKS:
                    continue
                why = f"vLLM stopped answering its health check ({FAILED_CHECKS} in a row)"
            else:
                why = f"vLLM exited with code {code}"
            self._restart(why)
            failed_checks = 0

    def _restart(self, why: str) -> None:
        log.error("%s; restarting it (its log: %s)", why, self._process.log_path)
        self._problem = f"{why}; restarting it"
        lost = self.generation
        for callback in self._lost:
            try:
                callback(lost)
            except Exception:  # the restart must happen whatever a listener does
                log.exception("a listener of vLLM's restart failed")
        for attempt in range(sys.maxsize):
            if self._closed.is_set():
                return
            try:
                self._process.stop(grace_s=5.0)
                started = self._server.start()
            except Exception as e:  # the supervisor must outlive any one failed start
                wait = BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)]
                self._problem = f"{why}; restart {attempt + 1} failed, next in {wait:.0f} s: {e}"
                log.error("%s", self._problem)
                self._closed.wait(wait)
                continue
            self._process = started
            if self._closed.is_set():  # the worker closed while this one started
                started.stop(grace_s=5.0)
                return
            break
        self.generation = lost + 1
        self._problem = None
        log.info("vLLM is back (generation %d)", self.generation)

    @property
    def queue_depth(self) -> int:
        # Waiting for one of MAX_GENERATIONS; vLLM's own queue counts as running.
        return self._calls.waiting

    @property
    def batch_size(self) -> int:
        return self._running

    @property
    def request_path_loads(self) -> int:
        # Not measured: MinT loads every adapter at prewarm, but vLLM moves adapters between
        # its CPU cache and its device slots by itself, on the request path, and does not
        # report it. Its own /metrics are the place to look.
        return 0

    def close(self) -> None:
        self._closed.set()
        self._supervisor.join(timeout=10)
        self._calls.close()  # every generation running or waiting fails: its caller hears
        self._client.close()
        self._process.stop(grace_s=5.0)  # within the grace a stopping worker has
        self._server.remove()
        shutil.rmtree(self._adapters, ignore_errors=True)
