"""Options declared once, used everywhere: each component's settings are the fields of its frozen
dataclass (EngineConfig, RouterConfig, PrefillConfig, DecodeConfig, SecurityConfig, ...), and
everything else is derived from those fields here: command-line flags (`python -m router |
prefill_node | decode_node`, `pdserve up`), the argv `pdserve up` forwards to its node processes,
and the Serve config's sections (`pdserve.ray_app`).

A field's metadata (engine/config.py's `option()` writes it):
    help     what it does; a field without help is not an option. A bool that is on by default has
             a flag that turns it off: its help says what that flag does
    flag     its flag where that is not --field-name: "--no-prefix-caching" for a bool that is on by
             default (the flag turns it off), "--kv-cache-gb" for a value given in another unit
    unit     the flag takes value / unit (bytes given in GiB: unit 2**30)
    choices  the allowed values
    where    the entry points it applies to, of ("cli", "serve"); default both
    serve_key  its key in a Serve config section, where that is not the field's name
    per_process  True for a value each process needs its own of (a port): never forwarded
A class's `cli_title` (a plain class attribute) heads its options' section of --help.
Types: str, int, float, bool, dict (a JSON object on the command line), and `X | None`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from dataclasses import dataclass
from typing import Any

ENTRY_POINTS = ("cli", "serve")


@dataclass(frozen=True)
class Option:
    name: str  # the field's name, and the argparse dest
    kind: type  # str, int, float, bool or dict
    default: Any
    help: str
    flag: str
    choices: tuple | None = None
    unit: float | None = None
    where: tuple[str, ...] = ENTRY_POINTS
    key: str = ""  # its Serve config key
    per_process: bool = False

    def to_cli(self, value):
        """A field value as the flag takes it (the inverse of from_cli)."""
        return value / self.unit if self.unit and value is not None else value

    def from_cli(self, value):
        return int(value * self.unit) if self.unit and value is not None else value


def options(cls, where: str | None = None) -> list[Option]:
    """The options a config dataclass declares (those that apply to `where`, if given)."""
    hints = typing.get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if "help" not in meta or (where is not None and where not in meta.get("where", ENTRY_POINTS)):
            continue
        kind = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        flag = meta.get("flag") or (
            f"--no-{f.name.replace('_', '-')}" if kind is bool and default else f"--{f.name.replace('_', '-')}"
        )
        found.append(
            Option(
                f.name,
                kind,
                default,
                meta["help"],
                flag,
                meta.get("choices"),
                meta.get("unit"),
                tuple(meta.get("where", ENTRY_POINTS)),
                meta.get("serve_key", f.name),
                meta.get("per_process", False),
            )
        )
    return found


def _base_type(hint) -> type:
    """int for `int | None`, and so on."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    return typing.get_origin(hint) or hint


# ---- command lines ----------------------------------------------------------------------
class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows every option's default: a help text that names its default in words
    ("default: torch's choice") keeps it; unset means "none", a flag's default is "off"; a
    required option says so."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.required:
            return f"{text} (required)".lstrip()
        if "default:" in text or not action.option_strings or action.default is argparse.SUPPRESS:
            return text
        if action.nargs == 0:  # store_true / store_false: the flag is not given
            shown = "off"
        elif action.default is None or action.default == []:
            shown = "none"
        else:
            shown = "%(default)s"
        return f"{text} (default: {shown})".lstrip()


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def add_options(
    parser: argparse.ArgumentParser, *classes, title: str | None = None, skip=(), only=None, helps: dict | None = None
) -> None:
    """Adds the command-line options of these config classes (an option whose name a class before
    it, or the parser, already has is added once: one flag sets both). skip, only: option names
    left out, or the only ones added; helps: a command's own help for an option (e.g. the default
    `pdserve up` picks for it)."""
    known = {a.dest for a in parser._actions}
    for cls in classes:
        heading = title or getattr(cls, "cli_title", None)  # a class's own section of --help
        group = parser.add_argument_group(heading) if heading else parser
        for opt in options(cls, "cli"):
            if opt.name in known or opt.name in skip or (only is not None and opt.name not in only):
                continue
            known.add(opt.name)
            default, text = opt.to_cli(opt.default), (helps or {}).get(opt.name, opt.help)
            if opt.kind is bool:
                group.add_argument(
                    opt.flag, dest=opt.name, action="store_false" if opt.default else "store_true", help=text
                )
                continue
            kind = {dict: json_object}.get(opt.kind, float if opt.unit else opt.kind)
            metavar = "JSON" if opt.kind is dict else opt.flag.lstrip("-").upper().replace("-", "_")
            group.add_argument(
                opt.flag,
                dest=opt.name,
                type=kind,
                default=default,
                choices=opt.choices,
                help=text,
                metavar=None if opt.choices else metavar,
            )


def from_args(cls, args: argparse.Namespace, **given):
    """A config from parsed flags (the options of cls the parser has), plus `given` fields.
    Raises ValueError, naming the field, for a value the config refuses."""
    values = {o.name: o.from_cli(getattr(args, o.name)) for o in options(cls, "cli") if hasattr(args, o.name)}
    return cls(**{**values, **given})


def to_argv(args: argparse.Namespace, *classes, skip=()) -> list[str]:
    """The flags that give a process the same values of these classes' options as `args` holds
    (those that differ from the defaults, but per-process ones): how `pdserve up` forwards its
    options to a node."""
    argv, seen = [], set(skip)
    for cls in classes:
        for opt in options(cls, "cli"):
            if opt.name in seen or opt.per_process or not hasattr(args, opt.name):
                continue
            seen.add(opt.name)
            value = getattr(args, opt.name)
            if value == opt.to_cli(opt.default):
                continue
            if opt.kind is bool:
                argv.append(opt.flag)
            else:
                argv += [opt.flag, json.dumps(value) if opt.kind is dict else str(value)]
    return argv


# ---- Serve config sections ------------------------------------------------------------------
def check_keys(section: str, given, allowed) -> None:
    """Raises ValueError naming the section's unknown keys (Serve itself would drop them)."""
    if not isinstance(given, dict):
        raise ValueError(f"{section} must be a mapping, got {type(given).__name__}")
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise ValueError(f"{section}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")


def serve_keys(*classes) -> set[str]:
    return {o.key for cls in classes for o in options(cls, "serve")}


def from_mapping(cls, section: str, given: dict, **fixed):
    """A config from (its keys of) a Serve config section, checked by the config itself;
    ValueErrors name the section. fixed: fields the application sets, not the section."""
    keys = {o.key: o.name for o in options(cls, "serve")}
    try:
        return cls(**{keys[k]: v for k, v in given.items() if k in keys}, **fixed)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{section}: {e}") from None
