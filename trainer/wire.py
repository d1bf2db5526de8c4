"""The Tinker SDK's protobuf messages, read and written: a forward/backward request in, its
output and a sampling result out. The message definitions are the SDK's own generated module
(`tinker.proto`), so what this writes is what the SDK's `response_conv` reads.

Everything else on the wire is JSON (`trainer.bodies`, read by the routes in `trainer.routes`).
"""

import io
from dataclasses import dataclass, field

import numpy as np
import zstandard
from tinker.proto import tinker_public_pb2 as pb

from mint_core.errors import ConfigurationError, clip
from serving.http.errors import BodyTooLarge

PROTOBUF = "application/x-protobuf"
MAX_REQUEST_BYTES = 16 << 20
"""Largest request body the trainer takes, after decompression: the SDK splits a
forward_backward into requests of about 5 MB (`fwdbwd_max_chunk_bytes_count`); every other
body is a few KB."""
MAX_DATUMS = 1024
"""Most datums in one forward_backward request (the SDK's `fwdbwd_max_chunk_len`)."""
_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


@dataclass(frozen=True)
class Datum:
    """One training example: its input tokens and its loss inputs (`target_tokens`, `weights`,
    `logprobs`, `advantages`), each a 1-D array as long as the input."""

    tokens: np.ndarray
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class ForwardBackward:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: tuple[Datum, ...]

    @property
    def tokens(self) -> int:
        return sum(len(d.tokens) for d in self.data)


def read_forward_backward(
    body: bytes, encoding: str | None, limit: int = MAX_REQUEST_BYTES
) -> ForwardBackward:
    """The SDK's `ForwardBackwardRequest` (zstd-compressed when `encoding` says so), of at most
    `limit` bytes decompressed (BodyTooLarge past it); ConfigurationError naming what is not
    one MinT can run."""
    coding = (encoding or "").strip().lower()
    if coding not in ("zstd", "identity", ""):
        raise ConfigurationError(
            f"content-encoding {clip(repr(encoding))} is not one this trainer reads; send zstd "
            "or none"
        )
    if coding == "zstd":
        body = decompress(body, limit)
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception as e:  # protobuf's DecodeError: what it says is of no use to the client
        raise ConfigurationError(
            "the body is not a ForwardBackwardRequest protobuf (tinker.proto); send the SDK's"
        ) from e
    if len(message.data) > MAX_DATUMS:
        raise ConfigurationError(
            f"forward_backward has {len(message.data)} datums, more than {MAX_DATUMS} in one "
            "request; send fewer (the SDK splits a batch into requests of at most that many)"
        )
    config: dict[str, float | str] = dict(message.loss_fn_config)
    for key, value in message.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else value.number
    data = []
    for i, datum in enumerate(message.data):
        tokens = []
        for chunk in datum.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise ConfigurationError(
                    f"datum {i} has a {chunk.WhichOneof('chunk')} chunk: mint trainer takes "
                    "text tokens only (EncodedTextChunk)"
                )
            raw = chunk.encoded_text.tokens
            if len(raw) % 4:
                raise ConfigurationError(
                    f"datum {i}: model_input tokens are {len(raw)} bytes, not whole int32s"
                )
            tokens.append(np.frombuffer(raw, dtype=np.int32))
        inputs = {name: _tensor(name, tensor, i) for name, tensor in datum.loss_fn_inputs.items()}
        data.append(
            Datum(
                np.concatenate(tokens).astype(np.int64) if tokens else np.zeros(0, np.int64), inputs
            )
        )
    return ForwardBackward(
        message.model_id,
        message.seq_id,
        message.loss_fn,
        config,
        message.forward_only,
        tuple(data),
    )


def decompress(body: bytes, limit: int) -> bytes:
    """`body`, a zstd frame, decompressed as a stream (a frame need not say its size) and no
    further than `limit` bytes: BodyTooLarge past it, ConfigurationError if it is no zstd."""
    reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body))
    out = bytearray()
    try:
        while piece := reader.read(min(1 << 20, limit + 1 - len(out))):
            out += piece
            if len(out) > limit:
                raise BodyTooLarge(limit)
    except zstandard.ZstdError as e:
        raise ConfigurationError(
            "the body is not zstd, as its content-encoding says; compress it with zstd or "
            "leave content-encoding out"
        ) from e
    return bytes(out)


def _tensor(name: str, tensor: "pb.Tensor", datum: int) -> np.ndarray:
    if tensor.WhichOneof("encoding") == "sparse_csr":
        raise ConfigurationError(
            f"datum {datum}: loss_fn_inputs[{name!r}] is sparse (2-D, top-k targets); mint "
            "trainer takes one target per position (1-D tensors)"
        )
    dtype = _NUMPY.get(tensor.dtype)
    if dtype is None:
        raise ConfigurationError(
            f"datum {datum}: loss_fn_inputs[{name!r}] has dtype {tensor.dtype}"
        )
    size = np.dtype(dtype).itemsize
    if len(tensor.dense) % size:
        raise ConfigurationError(
            f"datum {datum}: loss_fn_inputs[{name!r}] has {len(tensor.dense)} bytes, not whole "
            f"{np.dtype(dtype).name} values"
        )
    array = np.frombuffer(tensor.dense, dtype=dtype)
    if len(tensor.shape) == 1 and tensor.shape[0] != len(array):
        raise ConfigurationError(
            f"datum {datum}: loss_fn_inputs[{name!r}] has shape {list(tensor.shape)} but "
            f"{len(array)} values"
        )
    if len(tensor.shape) > 1:
        raise ConfigurationError(
            f"datum {datum}: loss_fn_inputs[{name!r}] has shape {list(tensor.shape)}; mint "
            "trainer takes 1-D inputs, one value per position"
        )
    return array


def forward_backward_output(
    outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]
) -> bytes:
    """The SDK's `ForwardBackwardOutput`: one `ArrayRecord` with a batched tensor per output
    field (each datum's slice at its byte offset)."""
    message = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics)
    record = message.loss_fn_outputs.add(num_datums=len(outputs), type_tag="ArrayRecord")
    for name in outputs[0] if outputs else ():
        arrays = [np.ascontiguousarray(out[name], dtype=np.float32) for out in outputs]
        offsets = np.cumsum([0, *(a.nbytes for a in arrays)]).astype(np.int64)
        batched = record.fields[name]
        batched.data = b"".join(a.tobytes() for a in arrays)
        batched.offsets = offsets.tobytes()
        batched.dtype = pb.DTYPE_FLOAT32
    return message.SerializeToString()


@dataclass(frozen=True)
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stopped: bool
    """Ended by a stop token or string (else by max_tokens)."""


def sample_response(sequences: list[Sequence], prompt_logprobs: list[float] | None) -> bytes:
    """The SDK's `SampleResponse`; `prompt_logprobs` has NaN where none was computed (the
    first prompt token)."""
    message = pb.SampleResponse()
    for sequence in sequences:
        message.sequences.add(
            stop_reason=pb.STOP_REASON_STOP if sequence.stopped else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(sequence.tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(sequence.logprobs, dtype=np.float32).tobytes(),
        )
    if prompt_logprobs is not None:
        message.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return message.SerializeToString()
