"""The trainer's refusals of hostile input, without a process: request bodies the SDK would not
send refused naming the field; compressed bodies decompressed no further than the limit; a
forward/backward request's values checked before it joins a pass (finite, whole token ids);
checkpoint paths checked before they name a file; and the error table's answers, a future's
failures too."""

from pathlib import Path

import pytest
import zstandard
from pydantic import ValidationError
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from mint_core.errors import (
    AccessDeniedError,
    ConfigurationError,
    IntegrityError,
    NotFoundError,
    RegistryError,
)
from serving.http.errors import BodyTooLarge
from trainer import bodies
from trainer.checkpoints import CheckpointPath
from trainer.compute import check_request
from trainer.errors import QueueFull, failure, trainer_error
from trainer.futures import Category, Failure
from trainer.service import names_folder
from trainer.wire import decompress, read_forward_backward

VOCAB = 100
CONTEXT = 32


def fb(targets: types.TensorData | list[int], weights: list[float] | None = None) -> bytes:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": targets, "weights": weights or [1.0, 1.0, 1.0]},
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
        model_id="m",
        seq_id=0,
    )
    return forward_backward_request_to_proto(request).SerializeToString()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"session_id": "s", "model_seq_id": float("inf"), "base_model": "b"}, "model_seq_id"),
        ({"session_id": "s", "model_seq_id": 1.0, "base_model": "b"}, "model_seq_id"),
        (
            {"session_id": "s", "model_seq_id": 0, "base_model": "b", "lora_config": [4]},
            "lora_config",
        ),
        (
            {"session_id": "s", "model_seq_id": 0, "base_model": "b", "lora_config": {"seed": "1"}},
            "seed",
        ),
        (
            {"session_id": "s", "model_seq_id": 0, "base_model": "b", "user_metadata": []},
            "user_metadata",
        ),
        ({"session_id": "s" * 5000, "model_seq_id": 0, "base_model": "b"}, "session_id"),
    ],
)
def test_a_create_model_body_the_sdk_would_not_send_is_refused_naming_the_field(
    body: dict[str, object], field: str
) -> None:
    with pytest.raises(ValidationError, match=field):
        bodies.CreateModel.model_validate(body)


def test_the_sdks_own_bodies_are_taken_with_their_extra_fields() -> None:
    sample = types.SampleRequest(
        sampling_session_id="s:sample:0",
        seq_id=1,
        num_samples=2,
        prompt=types.ModelInput.from_ints([1, 2]),
        sampling_params=types.SamplingParams(max_tokens=5, seed=3, stop=["\n"]),
    )
    taken = bodies.Sample.model_validate(sample.model_dump(mode="json"))
    assert taken.num_samples == 2 and taken.prompt.chunks[0].tokens == [1, 2]
    optim = types.OptimStepRequest(
        adam_params=types.AdamParams(learning_rate=1e-3), model_id="m", seq_id=2
    )
    assert (
        bodies.OptimStep.model_validate(optim.model_dump(mode="json")).params.learning_rate == 1e-3
    )
    with pytest.raises(ValidationError, match="num_samples"):
        bodies.Sample.model_validate({**sample.model_dump(mode="json"), "num_samples": 2_000_000})


def test_a_zstd_body_is_decompressed_as_a_stream_and_no_further_than_the_limit() -> None:
    data = b"x" * 10_000
    streamed = zstandard.ZstdCompressor().compressobj()
    unsized = streamed.compress(data) + streamed.flush()
    assert zstandard.frame_content_size(unsized) == -1
    assert decompress(unsized, 10_000) == data
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))
    with pytest.raises(BodyTooLarge):
        decompress(bomb, 1 << 20)
    with pytest.raises(ConfigurationError, match="not zstd"):
        decompress(b"plain bytes", 1 << 20)
    with pytest.raises(ConfigurationError, match="not a ForwardBackwardRequest"):
        read_forward_backward(b"\xff\xff\xff", None)


@pytest.mark.parametrize(
    ("targets", "weights", "named"),
    [
        (
            types.TensorData(data=[2.0, float("nan"), 4.0], dtype="float32", shape=[3]),
            None,
            "target_tokens",
        ),
        (types.TensorData(data=[2.0, 3.5, 4.0], dtype="float32", shape=[3]), None, "target_tokens"),
        ([2, 3, 4], [1.0, float("inf"), 1.0], "weights"),
        ([2, 3, 4], [1.0, float("nan"), 1.0], "weights"),
    ],
)
def test_values_that_are_no_numbers_or_no_token_ids_are_refused_before_a_pass(
    targets: types.TensorData | list[int], weights: list[float] | None, named: str
) -> None:
    request = read_forward_backward(fb(targets, weights), None)
    with pytest.raises(ConfigurationError, match=named):
        check_request(request, VOCAB, CONTEXT)


def test_a_checkpoint_path_is_checked_before_it_names_a_file() -> None:
    with pytest.raises(ConfigurationError, match="not a checkpoint path") as refused:
        CheckpointPath.parse(f"tinker://{'m' * 5000}/weights/b")
    assert len(str(refused.value)) < 500
    assert CheckpointPath.parse("tinker://s-1:train:0/weights/b").name == "b"


def test_the_error_table_answers_the_trainers_own_cases() -> None:
    assert trainer_error(QueueFull("wait")).status == 429
    assert trainer_error(NotFoundError("no model")).status == 404
    assert trainer_error(ConfigurationError("bad")).status == 422
    assert trainer_error(IntegrityError("digest differs")).status == 400  # not 503: no resend
    assert trainer_error(RegistryError("down")).status == 503
    bug = trainer_error(RuntimeError("secret /tmp/path"))
    assert bug.status == 500 and bug.headers["x-should-retry"] == "false"
    assert "secret" not in str(bug.body)


USER, SERVER = Category.USER, Category.SERVER


@pytest.mark.parametrize(
    ("error", "mint_errors", "expected"),
    [
        # A request's own work (queueing it, checking it, its optimizer step or checkpoint).
        (ConfigurationError("lr=-1"), USER, Failure("lr=-1", USER)),
        (AccessDeniedError("team-b may not"), USER, Failure("team-b may not", USER)),
        (IntegrityError("digest differs"), USER, Failure("digest differs", USER)),
        # What MinT does after taking the request (registering, sampling).
        (RegistryError("down"), SERVER, Failure("registering p failed: down", SERVER)),
        (IntegrityError("differs"), SERVER, Failure("registering p failed: differs", SERVER)),
        (AccessDeniedError("not yours"), SERVER, Failure("registering p failed: not yours", USER)),
        # A bug, whichever the work.
        (
            KeyError("secret"),
            USER,
            Failure("registering p failed (KeyError); the trainer's log has the details", SERVER),
        ),
        (
            KeyError("secret"),
            SERVER,
            Failure("registering p failed (KeyError); the trainer's log has the details", SERVER),
        ),
    ],
)
def test_a_future_fails_by_the_one_rule(
    error: Exception, mint_errors: Category, expected: Failure
) -> None:
    assert failure(error, "registering p", mint_errors) == expected


def test_a_base_named_by_another_path_to_its_folder_is_the_base(tmp_path: Path) -> None:
    """A cookbook script resolves its model path: through a link, it names the same folder."""
    folder = tmp_path / "models" / "tiny"
    folder.mkdir(parents=True)
    (tmp_path / "link").symlink_to(folder, target_is_directory=True)
    assert names_folder(str(tmp_path / "link"), folder)
    assert names_folder(str(tmp_path / "models" / ".." / "models" / "tiny"), folder)
    assert not names_folder(str(tmp_path / "models"), folder)
    assert not names_folder("org/tiny", folder)
