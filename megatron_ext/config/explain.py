"""Hydra's and OmegaConf's composition errors as one line that names the key, the value, the type
the schema expects and, for a typo, the nearest key the schema has:

    train.iters: expected int, got 'abc' (in train.iters=abc)
    train.itres: no such key (in train.itres=5); did you mean train.iters (int)?

Hydra's own advice for an unknown key, `+key=value`, is never given: the schema is closed, and a
key it lacks would be dropped when the config becomes the schema's dataclass, so the run would
silently train without it. `unknown_keys` refuses such keys however they got in.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, Iterator, Optional, Sequence

from omegaconf import DictConfig
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from megatron_ext.config.validate import ConfigError


def schema_keys(schema: type, prefix: str = "") -> dict[str, Any]:
    """Every dotted key of the dataclass `schema`, sections and fields, with its type hint."""
    keys: dict[str, Any] = {}
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        key, hint = f"{prefix}{f.name}", hints[f.name]
        keys[key] = hint
        section = section_type(hint)
        if section is not None:
            keys.update(schema_keys(section, f"{key}."))
    return keys


def section_type(hint: Any) -> Optional[type]:
    """The dataclass of a section's hint (`Section` or `Optional[Section]`), else None."""
    if dataclasses.is_dataclass(hint):
        return hint
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and len(args) == 1 and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def unset_section(overrides: Sequence[str], schema: type) -> Optional[ConfigError]:
    """An override into an optional section (null until its preset is chosen: `data.sft`, set
    by `data=sft`) given without that preset: OmegaConf would fail on it with an assertion."""
    keys = schema_keys(schema)
    for text in overrides:
        written = text.partition("=")[0].lstrip("+~")
        section = written.rpartition(".")[0]
        while section:
            hint = keys.get(section)
            group, _, name = section.partition(".")
            optional = hint is not None and not dataclasses.is_dataclass(hint) and section_type(hint) is not None
            if optional and f"{group}={name}" not in overrides:
                return ConfigError(written, f"{section} is null until its preset is chosen: add {group}={name} (in {text})")
            section = section.rpartition(".")[0]
    return None


def type_name(hint: Any) -> str:
    """A schema type as a user writes values of it: int, float or null, list of str, ..."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union:
        return " or ".join([*(type_name(a) for a in args), "null"])
    if typing.get_origin(hint) in (list, tuple):
        return f"list of {type_name(args[0])}" if args else "list"
    if typing.get_origin(hint) is dict:
        return "mapping"
    if dataclasses.is_dataclass(hint):
        return "a section"
    return "any value" if hint is Any else getattr(hint, "__name__", str(hint))


def nearest_key(key: str, schema: type) -> str:
    """'; did you mean <key> (<type>)?' for the schema key closest to `key`, or the keys of the
    section it is under when none is close."""
    keys = schema_keys(schema)
    # a dotted key is a field: a section is no answer to it
    candidates = [k for k, hint in keys.items() if "." not in key or not dataclasses.is_dataclass(hint)]
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]} ({type_name(keys[close[0]])})?"
    section = key.rpartition(".")[0]
    while section and section not in keys:
        section = section.rpartition(".")[0]
    inside = [k for k in keys if k.rpartition(".")[0] == section]
    return f"; {section or 'the config'} has: {', '.join(k.rpartition('.')[2] for k in inside)}"


def _omegaconf_cause(error: BaseException) -> Optional[OmegaConfBaseException]:
    """The first OmegaConf error in `error`'s chain that names a key."""
    seen = error
    while seen is not None:
        if isinstance(seen, OmegaConfBaseException) and getattr(seen, "full_key", None):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _override_of(key: str, overrides: Sequence[str]) -> Optional[str]:
    """The override (as written) that sets `key` or a key under it."""
    for text in overrides:
        written = text.partition("=")[0].lstrip("+~")
        if written == key or written.startswith(f"{key}."):
            return text
    return None


def composition_error(error: Exception, overrides: Sequence[str], schema: type) -> ConfigError:
    """`error`, raised by Hydra's compose for `overrides`, as a ConfigError of one line."""
    missing = getattr(error, "missing_cfg_file", None)
    if missing and "/" in missing:
        group, _, name = missing.rpartition("/")
        options = list(getattr(error, "options", None) or [])
        close = difflib.get_close_matches(name, options, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        return ConfigError(group, f"no preset {name!r}{hint} (presets: {', '.join(options) or 'none'})")
    cause = _omegaconf_cause(error)
    if cause is None:  # e.g. an override Hydra cannot parse: its own first lines say why
        return ConfigError("overrides", " ".join(str(error).strip().splitlines()[:2]))
    key = cause.full_key
    override = _override_of(key, overrides)
    where = f" (in {override})" if override else ""
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        written = override.partition("=")[0].lstrip("+~") if override else key
        return ConfigError(written, f"no such key{where}{nearest_key(written, schema)}")
    if isinstance(cause, ValidationError):
        hint = schema_keys(schema).get(key)
        expected = f"expected {type_name(hint)}, " if hint is not None else ""
        value = "null" if cause.value is None else repr(cause.value)
        return ConfigError(key, f"{expected}got {value}{where}")
    return ConfigError(key, f"{cause.msg.splitlines()[0]}{where}")


def unknown_keys(cfg: DictConfig, schema: type) -> None:
    """Refuse a key of `cfg` that the schema's sections do not have (added with `+key=` or by a
    YAML file): it would be dropped without a word."""
    outside = next(_keys_outside(cfg, schema, ""), None)
    if outside is not None:
        key, value = outside
        raise ConfigError(key, f"no such key (set to {value!r}){nearest_key(key, schema)}")


def _keys_outside(node: DictConfig, section: type, prefix: str) -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of each key of `node` that the dataclass `section` lacks, recursively
    through its sub-sections."""
    hints = typing.get_type_hints(section)
    for name, value in node.items_ex(resolve=False):
        key = f"{prefix}{name}"
        if name not in hints:
            yield key, value
        elif dataclasses.is_dataclass(hints[name]) and isinstance(value, DictConfig):
            yield from _keys_outside(value, hints[name], f"{key}.")
