"""YAML loading that remembers where each value came from.

Every mapping is loaded as a `SourceMap`: a plain dict that also knows the file and the
line of each of its keys. Inventory and profile errors quote `file:line` from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError


class SourceMap(dict):
    """A dict that knows the file and the 1-based line of itself and of each key."""

    path: str = "?"
    line: int | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.key_lines: dict[Any, int] = {}

    def line_of(self, key: Any) -> int | None:
        return self.key_lines.get(key, self.line)

    def error(self, message: str, key: Any = None) -> ConfigError:
        """A ConfigError pointing at this mapping, or at one of its keys."""
        return ConfigError(message, self.path, self.line_of(key) if key is not None else self.line)


class _Loader(yaml.SafeLoader):
    source_path = "?"


MERGE_TAG = "tag:yaml.org,2002:merge"


def _flatten_mapping(loader: Any, node: yaml.MappingNode) -> None:
    """PyYAML's merge-key expansion (`<<: *defaults`), remembering which keys of the mapping
    were written in it rather than merged into it (a mapping merged into another is flattened
    first, maybe before it is constructed itself)."""
    explicit = loader.__dict__.setdefault("_explicit_keys", {})
    if id(node) not in explicit and any(k.tag == MERGE_TAG for k, _ in node.value):  # others stay as written
        explicit[id(node)] = {id(k) for k, _ in node.value if k.tag != MERGE_TAG}
    yaml.constructor.SafeConstructor.flatten_mapping(loader, node)


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> SourceMap:
    """A SourceMap; merge keys as YAML 1.1 defines them: a key written in the mapping wins over a
    merged one, of several merged mappings the earlier wins (PyYAML orders them so). A key written
    twice is an error."""
    loader.flatten_mapping(node)
    explicit = loader._explicit_keys.get(id(node))  # None: no merge key, every key written here
    result = SourceMap()
    result.path = loader.source_path
    result.line = node.start_mark.line + 1
    written: set[Any] = set()
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            hash(key)
        except TypeError:
            raise ConfigError("a mapping key must be a plain value", loader.source_path,
                              key_node.start_mark.line + 1) from None
        if explicit is None or id(key_node) in explicit:  # merged pairs come first: a written key wins
            if key in written:
                raise ConfigError(f"duplicate key {key!r}", loader.source_path, key_node.start_mark.line + 1)
            written.add(key)
        result[key] = loader.construct_object(value_node, deep=True)
        result.key_lines[key] = key_node.start_mark.line + 1
    return result


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_Loader.flatten_mapping = _flatten_mapping


def without_location(error: ConfigError) -> str:
    """A ConfigError's message without its `file:line: ` prefix (to quote it at another place)."""
    text = str(error)
    if error.path is None:
        return text
    prefix = f"{error.path}:{error.line}: " if error.line is not None else f"{error.path}: "
    return text.removeprefix(prefix)


def read_text(path: str | Path, shown: str, what: str = "the file") -> str:
    """A file's text; a missing or unreadable file, or bytes that are not UTF-8, become a
    ConfigError with file:line (the line of the first bad byte)."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError("file not found", shown) from None
    except OSError as exc:
        raise ConfigError(f"cannot read file: {exc.strerror}", shown) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise ConfigError(f"{what} is not UTF-8 text (byte 0x{raw[exc.start]:02x}); save it as UTF-8",
                          shown, line) from None


def load_yaml(path: str | Path, display: str | None = None, what: str = "the file", fast: bool = False) -> Any:
    """Load one YAML document with file:line on every mapping; syntax errors become ConfigError
    with file:line. `fast`: parse with libyaml where PyYAML has it (a tenth of the pure-Python
    parser's time on a 10,000-host inventory)."""
    shown = display or str(path)
    text = read_text(path, shown, what)
    base = yaml.CSafeLoader if fast and getattr(yaml, "__with_libyaml__", False) else _Loader
    loader_cls = type("_BoundLoader", (base,), {"source_path": shown, "flatten_mapping": _flatten_mapping})
    if base is not _Loader:
        loader_cls.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
    try:
        return yaml.load(text, Loader=loader_cls)  # noqa: S506 - SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        problem = exc.problem or exc.context or "invalid YAML"
        raise ConfigError(f"invalid YAML: {problem}", shown, line) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML: {exc}", shown) from None


def line_at(data: Any, loc: tuple) -> int | None:
    """The line of the deepest mapping key along `loc` (a pydantic error location)."""
    line = getattr(data, "line", None)
    node = data
    for part in loc:
        if isinstance(node, SourceMap) and part in node:
            line = node.line_of(part)
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
            line = getattr(node, "line", line)
        else:
            break
    return line


def validation_error(exc: Any, data: Any, path: str, renamed: dict[str, str] | None = None) -> ConfigError:
    """The first error of a pydantic ValidationError as a ConfigError with file:line; a key the
    schema renamed (`renamed`: old -> new) says its new name."""
    first = exc.errors()[0]
    loc = tuple(first.get("loc", ()))
    where = ".".join(str(p) for p in loc) or "document"
    message = first.get("msg", "invalid value")
    if first.get("type") == "value_error":  # our validators' own sentence, without pydantic's prefix
        message = message.removeprefix("Value error, ")
    if first.get("type") == "extra_forbidden":
        message = f"unknown key '{loc[-1]}'"
        if len(loc) == 1 and loc[0] in (renamed or {}):
            message += f": it was renamed '{renamed[loc[0]]}'"
    return ConfigError(f"{where}: {message}", path, line_at(data, loc))


def load_model(path: str | Path, schema: Any, what: str) -> tuple[Any, SourceMap]:
    """Load a YAML mapping and validate it against a pydantic model; errors carry file:line."""
    shown = str(path)
    data = load_yaml(path, shown)
    if not isinstance(data, SourceMap):
        raise ConfigError(f"{what} must be a mapping", shown, 1)
    from pydantic import ValidationError  # here: the inventory reads YAML too, and never validates a model

    try:
        return schema.model_validate(data), data
    except ValidationError as exc:
        raise validation_error(exc, data, shown, getattr(schema, "RENAMED_KEYS", None)) from None
