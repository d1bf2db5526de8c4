"""How a settings table's fields are read from the environment and written back: each field
carries its `Setting` (variable, default, meaning, parser) in its metadata (`setting(...)`).
`MintConfig` is the table; these are its parts and the parsers several rows share."""

from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from enum import StrEnum
from typing import Any, TypeVar

from mint_core.errors import ConfigurationError

T = TypeVar("T")
E = TypeVar("E", bound=StrEnum)


@dataclass(frozen=True)
class Setting:
    """How one `MintConfig` field is set from the environment and written back to it."""

    env: tuple[str, ...]
    """The variables that set it (one, except where a field gathers several)."""
    doc: str
    """What the field means."""
    parse: Callable[..., Any]
    """The variables' texts, one argument each -> the field's value (ValueError if bad)."""
    show: Callable[[Any], tuple[str, ...]]
    """The field's value -> the texts `parse` gives it back from."""
    blank_is_default: bool = False
    """A variable set to blank text counts as unset (numbers, names of a closed set)."""

    def read(self, environ: Mapping[str, str], default: Any) -> Any:
        """The value `environ` sets; an unset variable reads as its default's text."""
        texts = []
        for name, default_text in zip(self.env, self.show(default), strict=True):
            text = environ.get(name)
            if text is None or (self.blank_is_default and not text.strip()):
                text = default_text
            texts.append(text)
        try:
            return self.parse(*texts)
        except ConfigurationError:
            raise
        except ValueError as e:  # a plain parser's complaint, told with the variable
            raise ConfigurationError(f"{self.env[0]}={texts[0]!r} {e}") from None

    def write(self, value: Any) -> dict[str, str]:
        return dict(zip(self.env, self.show(value), strict=True))


def setting(
    env: str,
    default: T,
    doc: str,
    parse: Callable[[str], T] | None = None,
    show: Callable[[T], str] = str,
    blank_is_default: bool = False,
) -> T:
    """A `MintConfig` field set by one variable `env`, `default` when unset; `parse` (default:
    the field's type applied to the text) and `show` turn text into the value and back."""
    read = parse if parse is not None else type(default)
    entry = Setting((env,), doc, read, lambda value: (show(value),), blank_is_default)
    return field(default=default, metadata={SETTING: entry})


SETTING = "setting"
"""The key of a `MintConfig` field's `Setting` in its metadata."""


def settings_of(table: type) -> list[tuple[Field[Any], Setting]]:
    """Each field of settings table `table` (a dataclass of `setting(...)` fields) with its
    `Setting`."""
    return [(f, f.metadata[SETTING]) for f in fields(table)]


def default_of(f: Field[Any]) -> Any:
    return f.default_factory() if f.default is MISSING else f.default  # type: ignore[misc]


def variable_of(table: type, name: str) -> str:
    """The environment variable that sets `table`'s field `name` (its first, where several
    do)."""
    return next(entry.env[0] for f, entry in settings_of(table) if f.name == name)


def whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError("is not a whole number") from None


def milliseconds(text: str) -> float:
    return whole(text) / 1000


def show_milliseconds(seconds: float) -> str:
    return str(round(seconds * 1000))


def one_of(kind: type[E]) -> Callable[[str], E]:
    """A parser of the names of closed set `kind` (any case, spaces around ignored)."""

    def parse(text: str) -> E:
        try:
            return kind(text.strip().lower())
        except ValueError:
            raise ValueError(f"is not one of {', '.join(kind)}") from None

    return parse


def names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def urls(text: str) -> tuple[str, ...]:
    return tuple(url.rstrip("/") for url in names(text))
