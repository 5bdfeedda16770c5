"""Command-line helpers shared by the server and the benchmarks (torch-free)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Self, TypeVar

T = TypeVar("T")

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "ki": 2**10,
    "kib": 2**10,
    "mi": 2**20,
    "mib": 2**20,
    "gi": 2**30,
    "gib": 2**30,
    "ti": 2**40,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """'2GiB' -> 2147483648, '512MB' -> 512000000, '1e9' is not accepted, '4096' -> 4096."""
    match = _SIZE_RE.match(text)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (use bytes or a suffix such as 512MiB, 2GiB, 1GB)")
    value = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
    if value <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return value


def size_arg(text: str) -> int:
    """parse_size as an argparse `type`: its message, not argparse's generic one, on a bad value."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def on_off(text: str) -> bool:
    """'on' -> True, 'off' -> False, as an argparse `type`."""
    value = {"on": True, "off": False}.get(text.strip().lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return value


def auto_on_off(text: str) -> bool | None:
    """'auto' -> None (the program decides), 'on' -> True, 'off' -> False, as an argparse `type`."""
    if text.strip().lower() == "auto":
        return None
    try:
        return on_off(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected auto, on or off, got {text!r}") from None


# ---- flags declared on config dataclasses -----------------------------------------------------------
#
# A config field that the command line sets says so where it is defined:
#
#     max_num_seqs: int = flag(64, "most requests per iteration (ORCA's max_bs)")
#
# so each knob's default, flag and help are written once, and every program that takes a config's
# flags (the server, the benchmarks) gets the same ones from `add_flags(parser, Config)`.

_PLAIN_TYPES: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "str": str}


@dataclass(frozen=True)
class Flag:
    """How `add_flags` exposes one config field (the field's default is the flag's)."""

    help: str | None = None
    name: str | None = None  # default: --the-field-name
    short: str | None = None  # e.g. "-tp"
    type: Callable[[str], Any] | None = None  # default: from the annotation (int, float, str)
    choices: Sequence[str] | None = None
    metavar: str | None = None
    # "store_true" / "store_false" / argparse.BooleanOptionalAction for a bool field
    action: str | type[argparse.Action] | None = None
    exclusive: str | None = None  # flags naming the same group are mutually exclusive


def flag(default: Any, help: str | None = None, **spec: Any) -> Any:
    """A dataclass field with a command-line flag (see Flag)."""
    return field(default=default, metadata={"flag": Flag(help, **spec)})


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type) -> None:
    """One flag per field of `cls` declared with `flag(...)`, in field order."""
    exclusive: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for f in fields(cls):
        spec: Flag | None = f.metadata.get("flag")
        if spec is None:
            continue
        target: Any = parser
        if spec.exclusive is not None:
            if spec.exclusive not in exclusive:
                exclusive[spec.exclusive] = parser.add_mutually_exclusive_group()
            target = exclusive[spec.exclusive]
        names = [spec.name or "--" + f.name.replace("_", "-")] + ([spec.short] if spec.short else [])
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": spec.help}
        if spec.action is not None:
            kwargs["action"] = spec.action
        else:
            kwargs["type"] = spec.type or _PLAIN_TYPES[str(f.type).replace(" | None", "")]
            if spec.choices is not None:
                kwargs["choices"] = spec.choices
            if spec.metavar is not None:
                kwargs["metavar"] = spec.metavar
        target.add_argument(*names, **kwargs)


def from_flags(cls: type[T], args: argparse.Namespace, **others: Any) -> T:
    """The config the flags describe: each field from the flag of its name; fields a parser lacks keep
    their defaults; `others` gives the fields whose flags have other names or meanings."""
    named = {
        f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name) and f.name not in others
    }
    return cls(**named, **others)


class FlagGroup:
    """A config dataclass whose `flag(...)` fields are a group of command-line flags (--help shows them
    under FLAG_GROUP): the server and every benchmark add the same group and read the same config back."""

    FLAG_GROUP: ClassVar[str]

    @classmethod
    def add_cli_args(cls, p: argparse.ArgumentParser) -> None:
        add_flags(p.add_argument_group(cls.FLAG_GROUP), cls)

    @classmethod
    def from_cli_args(cls, a: argparse.Namespace) -> Self:
        """The config add_cli_args' flags describe (flags a parser lacks keep their defaults)."""
        return from_flags(cls, a)
