"""The Tinker SDK's protobuf messages, read and written: a forward/backward request in, its
output and a sampling result out. The message definitions are the SDK's own generated module
(`tinker.proto`), so what this writes is what the SDK's `response_conv` reads.

Everything else on the wire is JSON (the SDK's pydantic models, read in `trainer.app`).
"""

from dataclasses import dataclass, field

import numpy as np
import zstandard
from tinker.proto import tinker_public_pb2 as pb

from mint_core.errors import ConfigurationError

PROTOBUF = "application/x-protobuf"
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


def read_forward_backward(body: bytes, encoding: str | None) -> ForwardBackward:
    """The SDK's `ForwardBackwardRequest` (zstd-compressed when `encoding` says so);
    ConfigurationError naming what is not one MinT can run."""
    if encoding == "zstd":
        body = zstandard.ZstdDecompressor().decompress(body)
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception as e:  # protobuf's DecodeError
        raise ConfigurationError(f"the body is not a ForwardBackwardRequest protobuf: {e}") from e
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
            tokens.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
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
    array = np.frombuffer(tensor.dense, dtype=dtype)
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
