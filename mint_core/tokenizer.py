"""A character-level tokenizer for MinT's tiny base model.

Token ids are ASCII code points, so the vocabulary needs no file and no download. Ids 0-2 are
control codes that never occur in text and serve as padding, begin and end of sequence.
"""

from collections.abc import Sequence

from mint_core.errors import ConfigurationError

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
VOCAB_SIZE = 128
_FIRST_PRINTABLE, _LAST_PRINTABLE = 32, 126


class CharTokenizer:
    """Printable ASCII in, one token per character out."""

    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID
    vocab_size = VOCAB_SIZE

    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        ids = [BOS_ID] if bos else []
        for position, char in enumerate(text):
            code = ord(char)
            if not _FIRST_PRINTABLE <= code <= _LAST_PRINTABLE:
                raise ConfigurationError(
                    f"character {char!r} at position {position} of {text!r} is outside the "
                    "tiny base model's vocabulary; use printable ASCII (space to '~')"
                )
            ids.append(code)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of the ids up to (not including) the first end-of-sequence; control ids drop."""
        chars = []
        for token in ids:
            if token == EOS_ID:
                break
            if token >= _FIRST_PRINTABLE:
                chars.append(chr(token))
        return "".join(chars)

    def token_text(self, token: int) -> str:
        return chr(token) if token >= _FIRST_PRINTABLE else ""
