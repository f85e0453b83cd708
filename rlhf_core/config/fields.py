"""The building blocks of every config section: ``opt``/``required`` fields with their help text, and
``ConfigError``, the one exception a bad key or value raises."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import TYPE_CHECKING, Any, TypeGuard, cast

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

MISSING: Any = dataclasses.MISSING


class ConfigError(ValueError):
    """A config key is unknown, missing or has an invalid value; the message names the key."""


def required(help: str) -> Any:
    return field(default=MISSING, metadata={"help": help})


def opt(default: Any, help: str) -> Any:
    if isinstance(default, (list, dict, tuple)) or dataclasses.is_dataclass(default):
        return field(default_factory=lambda: _copy(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def _copy(value: Any) -> Any:
    return (
        dataclasses.replace(cast("DataclassInstance", value))
        if dataclasses.is_dataclass(value)
        else type(value)(value)
    )


def is_section(tp: Any) -> TypeGuard[type[Any]]:
    """``dataclasses.is_dataclass`` for a type hint (a class, never an instance): whether ``tp`` is a section."""
    return dataclasses.is_dataclass(tp)


def join_key(prefix: str, name: str) -> str:
    """The dotted key of field ``name`` in the section at ``prefix`` (``""`` = the top level)."""
    return f"{prefix}.{name}" if prefix else str(name)


def check(ok: bool, key: str, value: Any, why: str) -> None:
    """Raise ``ConfigError`` naming ``key`` and its ``value`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"invalid value {value!r} for '{key}': {why}")
