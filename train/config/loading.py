"""Reading a config (YAML, ``--set`` overrides, validation whose errors name the key path) and writing one back."""

from __future__ import annotations

import copy
import difflib
import re
from pathlib import Path
from typing import Any

import pydantic
import yaml
from pydantic import BaseModel

from train.config.model import LEGACY_TRANSFORMER_KEYS
from train.config.root import Config
from train.errors import ConfigError


# YAML 1.1 (PyYAML) reads "1e-3" as a string; users mean a float.
class _Loader(yaml.SafeLoader):
    pass


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:\d[\d_]*(?:\.\d*)?|\.\d+)[eE][-+]?\d+$"), list("-+0123456789.")
)


def parse_yaml(text: str, origin: str) -> Any:
    try:
        _refuse_duplicate_keys(yaml.compose(text, Loader=_Loader), origin)
        return yaml.load(text, Loader=_Loader)  # a SafeLoader subclass
    except yaml.YAMLError as e:
        raise ConfigError(f"{origin}: not valid YAML: {e}") from None


def _refuse_duplicate_keys(node: yaml.Node | None, origin: str, path: tuple[str, ...] = ()) -> None:
    """YAML lets a repeated key replace the first silently: a second ``train:`` section drops every key of the
    first. Any key twice in one mapping, at any depth, is an error naming both lines."""
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicate_keys(item, origin, (*path, str(i)))
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[str, int] = {}
    for key_node, value_node in node.value:
        key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else None
        if key is not None and key in seen:
            where = ".".join((*path, key))
            raise ConfigError(
                f"{origin}: '{where}' appears twice, at line {seen[key]} and line {key_node.start_mark.line + 1}; "
                "YAML would silently keep only the second (a whole section, when it is one). Merge the two into one"
            )
        if key is not None:
            seen[key] = key_node.start_mark.line + 1
        _refuse_duplicate_keys(value_node, origin, (*path, key or "?"))


def apply_override(tree: dict, override: str) -> None:
    """Set ``a.b.c=value`` in a nested dict; the value is parsed as YAML (``3`` is an int, ``x`` a string)."""
    key, sep, raw = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {override!r} must look like key.path=value, e.g. train.epochs=3")
    parts = key.strip().split(".")
    if len(parts) == 2 and parts[0] == "model" and parts[1] in LEGACY_TRANSFORMER_KEYS:
        parts.insert(1, "transformer")  # the older name: the override sets what it always meant
    if parts[:2] == ["model", "transformer"] and len(parts) == 3 and isinstance(tree.get("model"), dict):
        tree["model"].pop(parts[2], None)  # the file's value under the older name is what the override replaces
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {'.'.join(parts[: i + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = parse_yaml(raw, f"override {override!r}")


def _walk(loc: tuple) -> tuple[list[str], list[str]]:
    """Split a pydantic error location into the user's key path and the valid keys at its end.

    Pydantic adds the member of a union type to the location ('compile.enabled.bool'); those parts are
    not keys the user wrote, so they are dropped.
    """
    node: Any = Config
    path: list[str] = []
    for part in loc:
        if isinstance(node, tuple):  # ("dict", value type): this part is a key the user chose
            path.append(str(part))
            node = node[1]
            continue
        if isinstance(node, type) and issubclass(node, BaseModel) and str(part) in node.model_fields:
            path.append(str(part))
            annotation = node.model_fields[str(part)].annotation
            is_dict = getattr(annotation, "__origin__", None) is dict
            node = ("dict", annotation.__args__[-1]) if is_dict else annotation
        elif isinstance(node, type) and issubclass(node, BaseModel):
            path.append(str(part))  # an unknown key: the end of the path
            break
    if isinstance(node, type) and issubclass(node, BaseModel):
        return path, list(node.model_fields)
    return path, []


# Keys that moved to another section: an old config gets told where they went.
_MOVED = {"train.compile": "compile.enabled", "train.compile_mode": "compile.mode"}


def _describe(errors: list[dict]) -> list[tuple[str, str]]:
    """Each problem as (the key path it is about, a line for the user)."""
    by_path: dict[str, list[dict]] = {}
    lines = []
    for error in errors:
        loc = tuple(error["loc"])
        if error["type"] == "extra_forbidden":
            path, _ = _walk(loc)
            section, valid = _walk(loc[:-1])
            close = difflib.get_close_matches(str(loc[-1]), valid, n=1)
            if ".".join(path) in _MOVED:
                hint = f" (moved: use '{_MOVED['.'.join(path)]}')"
            elif close:
                hint = f" (did you mean '{'.'.join(path[:-1] + close)}'?)"
            else:
                hint = f" (the keys of {'.'.join(section) or 'the top level'} are: {', '.join(valid)})"
            lines.append((".".join(path), f"unknown key '{'.'.join(path)}'{hint}"))
        elif error["type"] == "missing":
            where = ".".join(_walk(loc)[0])
            lines.append((where, f"missing required key '{where}'"))
        elif error["type"] == "value_error":
            where = ".".join(_walk(loc)[0])
            msg = error["msg"].removeprefix("Value error, ")
            lines.append((where, f"'{where}': {msg}" if where else msg))
        else:
            by_path.setdefault(".".join(_walk(loc)[0]), []).append(error)
    for path, errs in by_path.items():
        msgs = " or ".join(dict.fromkeys(e["msg"] for e in errs))
        lines.append((path, f"'{path}': {msgs} (got {errs[0].get('input')!r})"))
    return lines


def _override_of(path: str, overrides: dict[str, str]) -> str | None:
    """The --set override that set ``path``, a section above it, or a key below it."""
    for key, override in overrides.items():
        if path == key or path.startswith(key + ".") or (path and key.startswith(path + ".")):
            return override
    return None


def validate(tree: Any, origin: str, overrides: dict[str, str] | None = None, file_tree: Any = None) -> Config:
    """The typed config of ``tree``; ``overrides``: the --set overrides applied to it by key path, so that a
    problem they caused is blamed on them rather than on the file; ``file_tree``: the file's own tree, before
    them (a problem of several keys at once, which names no one key, is the overrides' when the file alone is
    valid)."""
    if tree is None:
        tree = {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{origin}: the top level must be a mapping of sections, got {type(tree).__name__}")
    try:
        return Config.model_validate(tree)
    except pydantic.ValidationError as e:
        found = [(line, _override_of(path, overrides or {})) for path, line in _describe(e.errors())]
        if overrides and file_tree is not None and not all(override for _, override in found):
            try:
                Config.model_validate(file_tree)
            except pydantic.ValidationError:
                pass
            else:  # the file alone is valid: the overrides together made it invalid
                every = ", ".join(dict.fromkeys(overrides.values()))
                found = [(line, override or every) for line, override in found]
        if all(override for _, override in found):  # the file is fine: name the overrides alone
            where = ", ".join(dict.fromkeys(override for _, override in found))
            problems = "\n".join(f"  - {line}" for line, _ in found)
            raise ConfigError(f"{where}: invalid override of {origin}:\n{problems}") from None
        problems = "\n".join(f"  - {line}{f' (set by {o})' if o else ''}" for line, o in found)
        raise ConfigError(f"{origin}: invalid config:\n{problems}") from None


def load_config(path: str | Path | None, overrides: list[str] = (), run_name: str | None = None) -> Config:
    """Read a YAML config (or none: defaults only), apply ``key=value`` overrides, validate."""
    tree: Any = {}
    origin = "config"
    if path is not None:
        path = Path(path)
        origin = str(path)
        if not path.is_file():
            raise ConfigError(f"config file '{path}' not found; pass an existing YAML file (see configs/)")
        tree = parse_yaml(path.read_text(), origin)
        if tree is None:
            tree = {}
        if not isinstance(tree, dict):
            raise ConfigError(f"{origin}: the top level must be a mapping of sections, got {type(tree).__name__}")
        if path.stem and (tree.get("run") or {}).get("name") is None:
            tree.setdefault("run", {})
            if isinstance(tree["run"], dict):
                tree["run"] = {**tree["run"], "name": path.stem}
    set_by, file_tree = {}, copy.deepcopy(tree)
    for override in overrides:
        apply_override(tree, override)
        set_by[override.partition("=")[0].strip()] = f"--set {override}"
    if run_name is not None:
        if not isinstance(tree.get("run", {}), dict):
            raise ConfigError(f"{origin}: 'run' must be a section")
        tree["run"] = {**tree.get("run", {}), "name": run_name}
        set_by["run.name"] = f"--run {run_name}"
    return validate(tree, origin, set_by, file_tree)


def to_yaml(config: Config) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}
