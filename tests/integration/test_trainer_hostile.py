"""Hostile input at the trainer (the Tinker API), hand-made, one row per class of what issue 34
found: each answers a 4xx naming the field at fault (or a future that fails with category
`user` naming it), never a 5xx, and answers nothing of the trainer's internals (file paths,
Python exception reprs) nor more than a short prefix of what was sent. Then the cross-tenant
case with the real SDK: tenant A's NaN `target_tokens` fails A's request alone, tenant B's in
the same pass succeeds.

A real trainer process over HTTP on loopback, as in `test_trainer`."""

import dataclasses
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import numpy as np
import pytest
import tinker
import zstandard
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from mint_core.config import MintConfig
from mint_core.model.base import BaseModel
from processes import ManagedProcess
from trainer.server import start_trainer
from trainer.wire import MAX_REQUEST_BYTES

pytestmark = pytest.mark.slow

KEYS = {"tml-team-a": "team-a", "tml-team-b": "team-b"}
KEY = "tml-team-a"
LONG = "m" * 5000
"""A model id longer than any file name may be."""
ECHO_BOUND = 1000
"""Most characters of an answer: a message echoes a short prefix of what was sent."""
FUTURE_POLLS = 6
"""Most `retrieve_future` polls for one future. Each waits up to LONG_POLL_S (20 s) for it, and
a hostile request's future settles in one pass or is refused before it, so 6 polls (two
minutes) leave a loaded machine ample room, however slow each poll's own round trip is."""
INTERNALS = ("Traceback", "Error(", "Errno", "artifacts/", "/tmp/", "KeyError", "object has no")


@pytest.fixture(scope="module")
def trainer(config: MintConfig) -> Iterator[ManagedProcess]:
    process = start_trainer(dataclasses.replace(config, api_keys=KEYS))
    yield process
    process.stop()


@dataclass(frozen=True)
class Ids:
    session: str
    model: str
    sampler: str


def api(trainer: ManagedProcess, route: str, body: dict[str, object]) -> httpx.Response:
    response = httpx.post(
        f"{trainer.url}/api/v1/{route}", json=body, headers={"X-API-Key": KEY}, timeout=60
    )
    assert response.status_code == 200, response.text
    return response


@pytest.fixture(scope="module")
def ids(trainer: ManagedProcess, base: BaseModel) -> Ids:
    """A session, a training model and a sampling session of tenant `KEY`, made over HTTP as
    the SDK makes them."""
    name = str(base.text.path)
    session = str(
        api(trainer, "create_session", {"tags": [], "sdk_version": "0.38"}).json()["session_id"]
    )
    created = api(
        trainer,
        "create_model",
        {"session_id": session, "model_seq_id": 0, "base_model": name, "lora_config": {"rank": 4}},
    )
    status, model = outcome(trainer, created)
    assert status == 200
    sampler = api(
        trainer,
        "create_sampling_session",
        {"session_id": session, "sampling_session_seq_id": 0, "base_model": name},
    )
    return Ids(session, model, str(sampler.json()["sampling_session_id"]))


@dataclass(frozen=True)
class Hostile:
    """One hand-made request: its route, body and headers, and what its refusal must name."""

    route: str
    body: bytes
    names: str
    headers: tuple[tuple[str, str], ...] = ()


def js(value: object) -> bytes:
    return json.dumps(value).encode()


def deep(depth: int) -> bytes:
    return b'{"session_id": ' + b"[" * depth + b"]" * depth + b"}"


def fb_proto(model_id: str) -> bytes:
    message = pb.ForwardBackwardRequest(model_id=model_id, seq_id=0, loss_fn="cross_entropy")
    datum = message.data.add()
    datum.model_input.add().encoded_text.tokens = np.arange(1, 4, dtype=np.int32).tobytes()
    for name, values, dtype in (
        ("target_tokens", [2, 3, 4], pb.DTYPE_INT64),
        ("weights", [1.0, 1.0, 1.0], pb.DTYPE_FLOAT32),
    ):
        tensor = datum.loss_fn_inputs[name]
        tensor.dtype = dtype
        tensor.shape.append(3)
        array = np.asarray(values, np.int64 if dtype == pb.DTYPE_INT64 else np.float32)
        tensor.dense = array.tobytes()
    return message.SerializeToString()


def unsized_zstd(data: bytes) -> bytes:
    """A zstd frame whose header has no content size (a streaming compressor's)."""
    compressor = zstandard.ZstdCompressor().compressobj()
    return compressor.compress(data) + compressor.flush()


ZSTD = (("content-encoding", "zstd"), ("content-type", "application/x-protobuf"))
PROTO = (("content-type", "application/x-protobuf"),)


def cases(ids: Ids) -> dict[str, Hostile]:
    s, m, sampler = ids.session, ids.model, ids.sampler
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
    sample = {"sampling_session_id": sampler, "seq_id": 0, "prompt": prompt, "sampling_params": {}}
    model = {"session_id": s, "model_seq_id": 7, "base_model": "x"}
    return {
        # A body that is not an object.
        "create_model list": Hostile("create_model", js([1, 2]), "body"),
        "optim_step string": Hostile("optim_step", js("adam"), "body"),
        "save_weights number": Hostile("save_weights", js(5), "body"),
        "load_weights null": Hostile("load_weights", js(None), "body"),
        "save_for_sampler list": Hostile("save_weights_for_sampler", js([]), "body"),
        "asample string": Hostile("asample", js("x"), "body"),
        "finish null": Hostile(f"sessions/{s}/finish", js(None), "body"),
        # Nested past any sane depth.
        "deep nesting": Hostile("session_heartbeat", deep(100_000), "nest"),
        # Numbers that are no integers.
        "num_samples Infinity": Hostile(
            "asample", json.dumps({**sample, "num_samples": float("inf")}).encode(), "num_samples"
        ),
        "max_tokens 1e400": Hostile(
            "asample",
            js(sample)[:-1] + b', "sampling_params": {"max_tokens": 1e400}}',
            "max_tokens",
        ),
        "model_seq_id Infinity": Hostile(
            "create_model", js(model)[:-1] + b', "model_seq_id": Infinity}', "model_seq_id"
        ),
        "rank 1e400": Hostile(
            "create_model", js({**model, "lora_config": {"rank": 1}})[:-3] + b"1e400}}", "rank"
        ),
        "prompt token Infinity": Hostile(
            "asample",
            js({**sample, "prompt": {"chunks": [{"tokens": [1]}]}}).replace(b"[1]", b"[Infinity]"),
            "tokens",
        ),
        "num_samples 2,000,000": Hostile(
            "asample", js({**sample, "num_samples": 2_000_000}), "num_samples"
        ),
        # Nested fields of the wrong type.
        "lora_config list": Hostile(
            "create_model", js({**model, "lora_config": [1]}), "lora_config"
        ),
        "user_metadata list": Hostile(
            "create_model", js({**model, "user_metadata": [1]}), "user_metadata"
        ),
        "adam_params string": Hostile(
            "optim_step", js({"model_id": m, "adam_params": "fast"}), "adam_params"
        ),
        "seed string": Hostile(
            "create_model", js({**model, "lora_config": {"rank": 4, "seed": "x"}}), "seed"
        ),
        "path integer": Hostile("save_weights", js({"model_id": m, "path": 5}), "path"),
        "reason string": Hostile(f"sessions/{s}/finish", js({"reason": "bored"}), "reason"),
        "prompt chunk not an object": Hostile(
            "asample", js({**sample, "prompt": {"chunks": [7]}}), "chunks"
        ),
        "session_id of 100 KB": Hostile(
            "session_heartbeat", js({"session_id": "s" * 100_000}), "session"
        ),
        # Bodies that are not what their encoding says, or too large.
        "body over the limit": Hostile(
            "session_heartbeat", js({"session_id": "s" * (MAX_REQUEST_BYTES + 1)}), "limit"
        ),
        "zstd that is not zstd": Hostile("forward_backward", b"not zstd at all", "zstd", ZSTD),
        "zstd bomb": Hostile(
            "forward_backward",
            zstandard.ZstdCompressor().compress(b"\0" * (256 << 20)),
            "limit",
            ZSTD,
        ),
        "protobuf that is not one": Hostile("forward_backward", b"\xff\xff\xff", "protobuf", PROTO),
        # Names longer than a file name.
        "5,000-char model id in a path": Hostile(
            "load_weights",
            js(
                {
                    "session_id": s,
                    "model_seq_id": 9,
                    "path": f"tinker://{LONG}/weights/b",
                    "optimizer": False,
                }
            ),
            "path",
        ),
        "5,000-char save name": Hostile("save_weights", js({"model_id": m, "path": LONG}), "path"),
    }


ROWS = [
    "create_model list", "optim_step string", "save_weights number", "load_weights null",
    "save_for_sampler list", "asample string", "finish null", "deep nesting",
    "num_samples Infinity", "max_tokens 1e400", "model_seq_id Infinity", "rank 1e400",
    "prompt token Infinity", "num_samples 2,000,000", "lora_config list", "user_metadata list",
    "adam_params string", "seed string", "path integer", "reason string",
    "prompt chunk not an object", "session_id of 100 KB", "body over the limit",
    "zstd that is not zstd", "zstd bomb",
    "protobuf that is not one", "5,000-char model id in a path", "5,000-char save name",
]  # fmt: skip


def outcome(trainer: ManagedProcess, response: httpx.Response) -> tuple[int, str]:
    """The status and message of an answer: its own, or for a 200 that answers a future, the
    future's: its error (category `user`, else the test fails), or its result's model_id."""
    if response.status_code != 200:
        return response.status_code, response.text
    request_id = response.json()["request_id"]
    for _ in range(FUTURE_POLLS):
        answer = httpx.post(
            f"{trainer.url}/api/v1/retrieve_future",
            json={"request_id": request_id},
            headers={"X-API-Key": KEY},
            timeout=60,
        ).json()
        if answer.get("type") == "try_again":
            continue
        if "error" in answer:
            assert answer.get("category") == "user", answer
            return 200, str(answer["error"])
        return 200, str(answer.get("model_id"))
    raise AssertionError(f"{request_id} did not finish in {FUTURE_POLLS} polls")


@pytest.fixture(scope="module")
def table(ids: Ids) -> dict[str, Hostile]:
    return cases(ids)


@pytest.mark.parametrize("row", ROWS)
def test_a_hostile_request_is_refused_naming_its_field(
    trainer: ManagedProcess, table: dict[str, Hostile], row: str
) -> None:
    case = table[row]
    response = httpx.post(
        f"{trainer.url}/api/v1/{case.route}",
        content=case.body,
        headers={"X-API-Key": KEY, "content-type": "application/json", **dict(case.headers)},
        timeout=60,
    )
    status, message = outcome(trainer, response)
    assert status < 500, (status, message[:500])
    assert status == 200 or (400 <= status < 500 and response.json()), message[:500]
    assert case.names in message.lower(), message[:500]
    assert len(message) < ECHO_BOUND, message[:500]
    assert not any(leak in message for leak in INTERNALS), message


def test_a_zstd_frame_without_a_content_size_is_read(trainer: ManagedProcess, ids: Ids) -> None:
    """The SDK's compressor writes the size; a streaming one does not: both are zstd."""
    response = httpx.post(
        f"{trainer.url}/api/v1/forward_backward",
        content=unsized_zstd(fb_proto(ids.model)),
        headers={"X-API-Key": KEY, **dict(ZSTD)},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    request_id = response.json()["request_id"]
    for _ in range(60):
        answer = httpx.post(
            f"{trainer.url}/api/v1/retrieve_future",
            json={"request_id": request_id},
            headers={"X-API-Key": KEY},
            timeout=60,
        )
        if answer.headers["content-type"] == "application/x-protobuf":
            return
        assert answer.json().get("type") == "try_again", answer.text
    raise AssertionError("the forward pass did not finish")


def test_one_tenants_nan_targets_fail_its_request_alone_not_the_pass(
    trainer: ManagedProcess, base: BaseModel
) -> None:
    """Tenant A's NaN target_tokens, tenant B's valid request, sent together so that they share
    one pass (the trainer gathers what arrives within a round): B gets its loss, A a user error
    naming target_tokens. Several rounds, so that at least one pass holds both."""
    good = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]},
    )
    nan = types.TensorData(data=[6.0, float("nan"), 8.0], dtype="float32", shape=[3])
    bad = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={"target_tokens": nan, "weights": [1.0, 1.0, 1.0]},
    )
    with (
        tinker.ServiceClient(base_url=trainer.url, api_key="tml-team-a") as a,
        tinker.ServiceClient(base_url=trainer.url, api_key="tml-team-b") as b,
    ):
        name = str(base.text.path)
        client_a = a.create_lora_training_client(base_model=name, rank=4).result()
        client_b = b.create_lora_training_client(base_model=name, rank=4).result()
        expected = client_b.forward([good], "cross_entropy").result().metrics["loss:sum"]

        def send(
            client: tinker.TrainingClient,
            datum: types.Datum,
            barrier: threading.Barrier,
            answer: list[object],
        ) -> None:
            barrier.wait()
            try:
                answer.append(client.forward([datum], "cross_entropy").result())
            except tinker.RequestFailedError as e:
                answer.append(e)

        for _ in range(3):
            barrier = threading.Barrier(2)
            answers: dict[str, list[object]] = {"a": [], "b": []}
            threads = [
                threading.Thread(target=send, args=(client_a, bad, barrier, answers["a"])),
                threading.Thread(target=send, args=(client_b, good, barrier, answers["b"])),
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            [failed] = answers["a"]
            assert isinstance(failed, tinker.RequestFailedError), failed
            assert failed.category is types.RequestErrorCategory.User
            assert "target_tokens" in str(failed) and "Error(" not in str(failed)
            [fine] = answers["b"]
            assert isinstance(fine, types.ForwardBackwardOutput), fine
            assert fine.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4)
