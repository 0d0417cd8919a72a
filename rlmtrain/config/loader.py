"""Reading a config: a TOML run file, then `--section.key=value` overrides (each value parsed as
a TOML literal; a bare word that is not one stays a string), validated against the schema and
its cross-field rules; and writing one back (`to_toml`, the README's reference table).

Errors never surface as tracebacks: an unknown key, a wrong type, an out-of-range value, a broken
cross-field rule or a missing file raises `ConfigError` with one line that names the key and the
file.
"""

from __future__ import annotations

import math
import tomllib
import typing
from pathlib import Path
from typing import Any, Literal

import msgspec

from rlmtrain.config.rules import preflight
from rlmtrain.config.schema import SECTIONS, Config, ConfigError, Section


def _validate(raw: dict[str, Any], source: str) -> Config:
    try:
        config = msgspec.convert(raw, Config, strict=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {_readable(str(exc))}") from None
    problem = _out_of_range(config) or preflight(config)
    if problem:
        raise ConfigError(f"{source}: {problem}")
    return config


_INT_MAX = 2**63 - 1


def _out_of_range(value: Any, where: str = "") -> str | None:
    """The first number no setting can mean: an infinite float (the schema's bounds let `inf`
    through where they have no upper one, and it would poison a run a step later) or an int
    past 64 bits (which torch and numpy cannot hold)."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"key '{where}': must be finite, got {value}"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > _INT_MAX:
        return f"key '{where}': must fit in 64 bits, got {value}"
    if isinstance(value, msgspec.Struct):
        fields = (
            (f"{where}.{name}" if where else name, getattr(value, name))
            for name in value.__struct_fields__
        )
    elif isinstance(value, dict):
        fields = ((f"{where}.{key}", item) for key, item in value.items())
    elif isinstance(value, (list, tuple)):
        fields = ((f"{where}[{i}]", item) for i, item in enumerate(value))
    else:
        return None
    for name, item in fields:
        problem = _out_of_range(item, name)
        if problem:
            return problem
    return None


def _readable(message: str) -> str:
    """'Object contains unknown field `x` - at `$.model`' -> "unknown key 'model.x'"."""
    text, _, where = message.partition(" - at `$")
    where = where.rstrip("`").lstrip(".")
    if text.startswith("Object contains unknown field"):
        field = text.split("`")[1]
        key = f"{where}.{field}" if where else field
        return f"unknown key '{key}'"
    if not where:
        return text
    return f"key '{where}': {text}"


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Read a TOML run file (None = all defaults), apply `section.key=value` overrides, validate."""
    raw: dict[str, Any] = {}
    source = "command line"
    if path is not None:
        source = str(path)
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{source}: config file not found")
        try:
            raw = tomllib.loads(p.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    apply_overrides(raw, overrides, source)
    return _validate(raw, source)


def split_overrides(arguments: list[str]) -> tuple[list[str], list[str]]:
    """The `--section.key=value` config overrides among `arguments`, and the rest."""
    overrides = [a for a in arguments if a.startswith("--") and "." in a.split("=", 1)[0]]
    return overrides, [a for a in arguments if a not in overrides]


def apply_overrides(raw: dict[str, Any], overrides: list[str], source: str = "overrides") -> None:
    """Apply `section.key=value` strings (a leading `--` is allowed) to a raw TOML dict in place."""
    for item in overrides:
        text = item[2:] if item.startswith("--") else item
        key, eq, value = text.partition("=")
        section, dot, field = key.partition(".")
        if not eq or not dot or not field or "." in field:
            raise ConfigError(f"{source}: override '{item}' is not of the form --section.key=value")
        if section not in SECTIONS:
            raise ConfigError(f"{source}: unknown key '{key}' (no section '{section}')")
        if field not in SECTIONS[section].__struct_fields__:
            raise ConfigError(f"{source}: unknown key '{key}'")
        parsed = _parse_value(value)
        # A text key takes the text as written: `--checkpoint.dir=1e3` is the folder "1e3".
        if _takes_text(SECTIONS[section], field) and not isinstance(parsed, str):
            parsed = value
        raw.setdefault(section, {})[field] = parsed


def _parse_value(value: str) -> Any:
    try:
        return tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return value


def _takes_text(section: type[Section], field: str) -> bool:
    hint = typing.get_type_hints(section)[field]
    if typing.get_origin(hint) is Literal:
        return all(isinstance(choice, str) for choice in typing.get_args(hint))
    return hint is str


def field_docs(section: type[Section]) -> dict[str, str]:
    """Field name -> one-line description, from the Annotated metadata."""
    docs = {}
    for name, hint in typing.get_type_hints(section, include_extras=True).items():
        metas = [m for m in getattr(hint, "__metadata__", ()) if isinstance(m, msgspec.Meta)]
        docs[name] = next((m.description for m in metas if m.description), "")
    return docs


def to_toml(config: Config, with_docs: bool = True) -> str:
    """The resolved config as TOML, each key preceded by its description."""
    lines: list[str] = []
    for name in Config.__struct_fields__:
        section = getattr(config, name)
        docs = field_docs(type(section))
        lines.append(f"[{name}]")
        for field in section.__struct_fields__:
            if with_docs and docs.get(field):
                lines.append(f"# {docs[field]}")
            lines.append(f"{field} = {_toml_value(getattr(section, field))}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return msgspec.json.encode(value).decode()
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def reference_markdown() -> str:
    """The config reference table printed in README.md (a test keeps the two in sync)."""
    lines = ["| key | default | meaning |", "|---|---|---|"]
    defaults = Config()
    for name in Config.__struct_fields__:
        section = getattr(defaults, name)
        docs = field_docs(type(section))
        for field in section.__struct_fields__:
            value = _toml_value(getattr(section, field))
            lines.append(f"| `{name}.{field}` | `{value}` | {docs[field]} |")
    return "\n".join(lines)
