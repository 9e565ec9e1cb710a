"""Ansible INI inventories, read line by line as ansible-core 2.19's `ini` plugin reads them.

    host0 ansible_port=2200          # before any section: the implicit 'ungrouped'
    [web]
    www[01:03].example.com ansible_user=deploy
    db.example.com:5309 x="a b"      # host:port; quoted values keep their blanks
    [web:vars]
    http_port=8080
    [prod:children]
    web

Host lines are split as a shell would (`shlex`, `#` starts a comment anywhere), the first word is
the host (ranges expand, `:port` splits off), the rest are `key=value`. Every value, inline or in
a `[group:vars]` line (where everything after the first `=` is the value), is read the way
Ansible reads it: as a Python literal where it is one (`23` and `"23"` an int, `True`, `[1, 2]`,
`'quoted'` a string, tuples and sets as lists), else the text itself. Lines starting with `#` or
`;` are comments. A `[group:vars]` or `:children` entry may name a group declared further down;
one never declared is an error, as in Ansible.

The hosts, groups and vars go into the same graph the YAML reader builds (`inventory._Parser`),
each with its file:line; every error Ansible would raise is a ConfigError at its line.
"""

from __future__ import annotations

import ast
import re
import shlex
import warnings
from typing import Any, Protocol

from ..errors import ConfigError
from ..spec.yamlsrc import SourceMap

COMMENT_MARKERS = ("#", ";")
_SECTION = re.compile(r"^\[([^:\]\s]+)(?::(\w+))?\]\s*(?:#.*)?$")
_GROUP_NAME = re.compile(r"^([^:\]\s]+)\s*(?:#.*)?$")
SECTION_KINDS = ("hosts", "children", "vars")


class Graph(Protocol):
    """What the INI reader needs from the inventory graph (inventory._Parser)."""

    groups: dict[str, Any]

    def add_group(self, name: str, where: SourceMap, key: Any) -> Any: ...
    def host_entry(self, group: Any, block: SourceMap, key: Any, host_vars: Any) -> None: ...
    def group_var(self, group: Any, block: SourceMap, var: Any, value: Any) -> None: ...
    def link(self, parent: str, child: str, where: SourceMap, key: Any) -> None: ...


_PLAIN_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")  # a name, dotted or dashed: never a literal
_PLAIN_INT = re.compile(r"0|[1-9][0-9]{0,17}")
_NAME_LITERALS = ("True", "False", "None")
_SHELL_SPECIAL = re.compile(r"[\"'\\#]")  # what makes shlex do more than split on blanks
_BLANKS = re.compile(r"[ \t\r\n]+")  # shlex's whitespace


def literal(text: str) -> Any:
    """An INI value as Ansible reads it: a Python literal where `ast.literal_eval` takes it, else
    the text; tuples and sets become lists, complex numbers and `...` stay text, bytes decode.
    Other failures of literal_eval (an unhashable dict key) are errors in Ansible too. (Plain
    names and integers, most values, skip the parser: ~1 s less on 10,000 hosts.)"""
    if _PLAIN_WORD.fullmatch(text) and text not in _NAME_LITERALS:
        return text
    if _PLAIN_INT.fullmatch(text):
        return int(text)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)
            value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    return _plain(value)


def _plain(value: Any) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if value is ... or isinstance(value, complex):
        return str(value) if value is not ... else "..."
    if isinstance(value, bytes):
        return value.decode("utf-8")
    return value


def decode(raw: bytes) -> str | None:
    """An INI file's text when it is not all UTF-8, as Ansible takes it: a comment line (its first
    byte `#` or `;`) may hold any bytes and reads as empty; None when another line is not UTF-8."""
    lines = []
    for line in raw.splitlines():
        if line[:1] in (b"#", b";"):
            lines.append("")
            continue
        try:
            lines.append(line.decode("utf-8"))
        except UnicodeDecodeError:
            return None
    return "\n".join(lines)


def _line_map(shown: str, number: int, items: dict[Any, Any] | None = None) -> SourceMap:
    """A SourceMap for one INI line: its keys and itself all at that line (file:line in errors)."""
    block = SourceMap(items or {})
    block.path, block.line = shown, number
    return block


def parse_ini(text: str, shown: str, graph: Graph) -> None:
    """Add the hosts, groups and vars of an INI inventory's text to `graph`; ConfigError at the
    offending line for whatever Ansible's ini plugin refuses."""
    reader = _Reader(shown, graph)
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line and line[0] not in COMMENT_MARKERS:
            try:
                reader.line(line, number)
            except ConfigError:
                raise
            except (TypeError, MemoryError, RecursionError, UnicodeDecodeError) as exc:
                # literal_eval failing otherwise than on syntax: Ansible fails the file here too
                raise ConfigError(f"cannot read the value on this line ({type(exc).__name__}: {exc})",
                                  shown, number) from None
    reader.finish()


class _Reader:
    """The ini plugin's state machine: the current group and what its section holds."""

    def __init__(self, shown: str, graph: Graph):
        self.shown = shown
        self.graph = graph
        self.group = "ungrouped"
        self.kind = "hosts"
        # groups named before they are declared: name -> (line, kind, parents naming it as a child)
        self.pending: dict[str, tuple[int, str, list[str]]] = {}

    def error(self, message: str, number: int) -> ConfigError:
        return ConfigError(message, self.shown, number)

    def line(self, line: str, number: int) -> None:
        section = _SECTION.match(line)
        if section:
            self.section(section.group(1), section.group(2), number)
        elif line.startswith("[") and line.endswith("]"):
            raise self.error(f"invalid section header {line!r}: a section is [group], [group:vars] or "
                             "[group:children], with no blanks and no other ':' or ']' in it", number)
        elif self.kind == "hosts":
            self.hosts(line, number)
        elif self.kind == "vars":
            self.var(line, number)
        else:
            self.child(line, number)

    def section(self, name: str, kind: str | None, number: int) -> None:
        kind = kind or "hosts"
        if kind not in SECTION_KINDS:
            raise self.error(f"section [{name}:{kind}] has unknown type '{kind}'; a section is [group] "
                             "(hosts), [group:vars] or [group:children]", number)
        self.group, self.kind = name, kind
        if name not in self.graph.groups:
            # [group] and [group:children] declare a group; [group:vars] needs it declared somewhere
            if kind == "vars" and name not in self.pending:
                self.pending[name] = (number, kind, [])
            self.graph.add_group(name, _line_map(self.shown, number, {name: None}), name)
        if name in self.pending and kind != "vars":
            if self.pending[name][1] == "children":
                self._adopt(name)
            else:
                del self.pending[name]

    def _adopt(self, name: str) -> None:
        """A group named in [parent:children] before its declaration joins those parents now."""
        number, _, parents = self.pending[name]
        for parent in parents:
            self.graph.link(parent, name, _line_map(self.shown, number, {name: None}), name)
            if parent in self.pending and self.pending[parent][1] == "children":
                self._adopt(parent)
        self.pending.pop(name, None)

    def hosts(self, line: str, number: int) -> None:
        try:
            words = shlex.split(line, comments=True) if _SHELL_SPECIAL.search(line) else _BLANKS.split(line)
        except ValueError as exc:
            raise self.error(f"cannot split the host line {line!r}: {exc} (quote values with blanks "
                             "as a shell would)", number) from None
        if not words:
            return
        key = words[0]
        if key.strip().endswith(":"):
            raise self.error(f"host '{key}' ends in ':', which Ansible reserves for a port (host:port)", number)
        if key.strip() == "---":
            raise self.error("a host named '---' is a sign this is a YAML file; check its YAML syntax", number)
        if not key:
            raise self.error("empty host name", number)
        host_vars = _line_map(self.shown, number)
        for word in words[1:]:
            name, sep, value = word.partition("=")
            if not sep:
                raise self.error(f"host '{key}': expected key=value after the host name, got {word!r}", number)
            host_vars[name] = literal(value)
            host_vars.key_lines[name] = number
        self.graph.host_entry(self.graph.groups[self.group], _line_map(self.shown, number, {key: None}),
                              key, host_vars)

    def var(self, line: str, number: int) -> None:
        name, sep, value = line.partition("=")
        if not sep:
            raise self.error(f"[{self.group}:vars] expects key=value, got {line!r}", number)
        name = name.strip()
        block = _line_map(self.shown, number, {name: None})
        self.graph.group_var(self.graph.groups[self.group], block, name, literal(value.strip()))

    def child(self, line: str, number: int) -> None:
        found = _GROUP_NAME.match(line)
        if not found:
            raise self.error(f"[{self.group}:children] expects a group name, got {line!r}", number)
        child = found.group(1)
        if child in self.graph.groups:
            self.graph.link(self.group, child, _line_map(self.shown, number, {child: None}), child)
        elif child in self.pending:
            self.pending[child][2].append(self.group)
        else:
            self.pending[child] = (number, "children", [self.group])

    def finish(self) -> None:
        for name, (number, kind, parents) in self.pending.items():  # Ansible reports the first
            if kind == "vars":
                raise self.error(f"section [{name}:vars] is for a group that is never declared "
                                 f"(no [{name}] or [{name}:children] section)", number)
            raise self.error(f"section [{parents[-1]}:children] names group '{name}', which is never "
                             f"declared (no [{name}] or [{name}:children] section)", number)
