"""Plain YAML values to a config section's typed fields: checked against each annotation and
converted only where that loses nothing, with errors that name the key."""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar, Union

from sdtrain.errors import ConfigError


@dataclass  # without fields (section is a ClassVar): so that a type[Section] is a dataclass to the type checker
class Section:
    """Base of a config section (training's and preprocessing's): knows its own name, so errors can
    say ``train.lr``."""

    section: ClassVar[str] = ""

    def _fail(self, key: str, message: str) -> typing.NoReturn:
        raise ConfigError(f"{self.section}.{key}: {message}")

    def _within(self, key: str, low: float, high: float, unit: str = "", also: str = "") -> None:
        """Refuse the number ``key`` outside [low, high], naming its value and the range; ``also`` is what else is
        allowed (``0``, ``auto``), which the caller checks. Not a number (None, auto): nothing to check."""
        value = getattr(self, key)
        if isinstance(value, (int, float)) and not low <= value <= high:
            allowed = f"{also + ' or ' if also else ''}in [{_shown(low)}, {_shown(high)}]{' ' + unit if unit else ''}"
            self._fail(key, f"must be {allowed}, got {_shown(value)}")


Tree = TypeVar("Tree", bound="ConfigTree")


class ConfigTree:
    """Base of a whole config (training's ``Config``, preprocessing's ``PreprocessConfig``): a dataclass of
    sections, built from nested plain data (YAML, ``to_dict`` output) by the one grammar every entrypoint shares
    (:mod:`sdtrain.config.loader`), with errors that name the key."""

    SECTIONS: ClassVar[dict[str, type[Section]]] = {}
    RENAMED: ClassVar[dict[str, str]] = {}
    """Old dotted key -> its new name: never accepted (a key has one name), only named in the error that refuses
    the old one."""

    @classmethod
    def from_dict(cls: type[Tree], raw: dict[str, Any]) -> Tree:
        """Build and validate the tree from nested plain data."""
        _refuse_old_names(cls.RENAMED, raw)
        raw = dict(raw)  # the caller's is kept: sections are popped from this one
        sections = {}
        for name, section_cls in cls.SECTIONS.items():
            value = raw.pop(name, None) or {}
            if not isinstance(value, dict):
                raise ConfigError(f"{name}: must be a mapping of keys, got {value!r}")
            sections[name] = build_section(section_cls, value)
        if raw:
            key = next(iter(raw))
            raise ConfigError(f"{key}: unknown section" + suggest(key, cls.SECTIONS))
        return cls(**sections)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]  # every subclass is a dataclass


def _refuse_old_names(renamed: dict[str, str], raw: dict[str, Any]) -> None:
    for old, new in renamed.items():
        section, _, key = old.partition(".")
        if isinstance(raw.get(section), dict) and key in raw[section]:
            raise ConfigError(f"{old}: was renamed {new}; set {new} instead")


def build_section(cls: type[Section], values: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in names:
            raise ConfigError(f"{cls.section}.{key}: unknown key" + suggest(key, names))
        kwargs[key] = coerce(f"{cls.section}.{key}", value, hints[key])
    return cls(**kwargs)


# Optional[X] and X | None: typing.Union and, before Python 3.14, types.UnionType.
_UNIONS = (Union, types.UnionType)


def coerce(key: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp``, converting only where it is lossless."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in _UNIONS:
        if value is None and type(None) in args:
            return None
        # A bare string for a list field means a one-element list (data.train: path).
        for arg in sorted((a for a in args if a is not type(None)), key=lambda a: typing.get_origin(a) is list):
            try:
                return coerce(key, value, arg)
            except ConfigError:
                pass
        raise ConfigError(f"{key}: expected {type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value in args and type(value) is type(args[args.index(value)]):
            return value
        raise ConfigError(f"{key}: must be one of {', '.join(map(str, args))}; got {value!r}")
    if origin is list:
        (item,) = args
        if item is str and isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list of {type_name(item)}, got {value!r}")
        return [coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        # YAML reads 1e-4 (no dot) as a string; accept any numeric spelling.
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            # No key means anything by NaN or infinity: NaN passes every range check (all comparisons are false).
            if not math.isfinite(number):
                raise ConfigError(f"{key}: must be a finite number, got {value!r}")
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, datetime.date):  # YAML reads 2026-11-22 as a date
            return value.isoformat()
    else:  # pragma: no cover - a new annotation kind must be taught here
        raise TypeError(f"unsupported config annotation {tp!r} for {key}")
    raise ConfigError(f"{key}: expected {type_name(tp)}, got {value!r} ({type(value).__name__})")


def type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in _UNIONS:
        names = [type_name(a) for a in args if a is not type(None)]
        return " | ".join(names) + (" | null" if type(None) in args else "")
    if origin is Literal:
        return " | ".join(map(str, args))
    if origin is list:
        return f"list of {type_name(args[0])}"
    if origin is dict:
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _shown(number: float) -> str:
    """A number as a message shows it: 1000000 rather than 1e+06, 1e+300 rather than 301 digits."""
    if isinstance(number, int) or (number.is_integer() and abs(number) < 1e15):
        return str(int(number))
    return f"{number:g}"


def suggest(key: str, choices: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(choices), n=1)
    return f" (did you mean {close[0]}?)" if close else f"; known: {', '.join(sorted(choices))}"
