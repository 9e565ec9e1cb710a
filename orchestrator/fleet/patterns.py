"""Host patterns (`ansible PATTERN`, `--limit`): which hosts a pattern selects, as ansible-core 2.19.

Splitting: once the pattern holds a `,`, it is split on commas only (so `web:&prod,db` is the two
terms `web:&prod` and `db`); a pattern that is one host address (`10.0.0.1`, `fe80::1`,
`web[1:3]`) is one term; otherwise terms are separated by `:` (and, as in Ansible, by blanks).

Evaluation: the plain terms in order (their union), then every `&term` (intersections), then
every `!term` (exclusions); only `&`/`!` terms means they apply to `all`. A plain term that is
a host name is that host. Otherwise a term is matched against group names (`all` and `ungrouped`
included) and, when no group matched or the term has `.`, `?`, `*`, `[` or is a `~regex`,
against host names: globs as fnmatch, `~regex` anchored at the start (`re.match`). `localhost`,
`127.0.0.1` and `::1` name Ansible's implicit local host when nothing else matches. A position
subscript `term[0]`, `[-1]`, `[0:2]` (inclusive), `[1:]` picks from the term's hosts in Ansible's
order.

Where Ansible warns and goes on, this module refuses (exit 2), so that a typo can never change
which hosts a rollout touches: an empty term, a term that matches nothing, an empty result, a
position past the end, the removed `[x-y]` subscript, and a position among hosts whose order
Ansible does not fix (see `GroupOrder`).
"""

from __future__ import annotations

import difflib
import fnmatch
import os
import re
from dataclasses import dataclass
from typing import Callable, NoReturn, Protocol, Sequence

from ..errors import ConfigError
from ..spec.yamlsrc import read_text, without_location
from .hostnames import NotAnAddress, parse_address

LOCALHOST_NAMES = ("127.0.0.1", "localhost", "::1")
_HOST_SCAN_CHARS = (".", "?", "*", "[")  # with these a term is tried on host names even when a group matched
_GLOB_CHARS = ("*", "?", "[")
_COLON_TERM = re.compile(r"(?:[^\s:\[\]]|\[[^\]]*\])+")
_SUBSCRIPT = re.compile(r"^(.+)\[(?:(-?[0-9]+)|([0-9]+)([:-])([0-9]*))\]$")


@dataclass(frozen=True)
class GroupOrder:
    """A group's hosts in Ansible's order; positions from `unfixed_from` on are not fixed.

    Ansible lists a group's own hosts, then its children's, then deeper descendants level by level;
    where two groups of one level both add nested groups, the order of those comes from a Python
    set of group objects, so it changes from run to run. Positions before `unfixed_from` are safe.
    """

    names: tuple[str, ...]
    unfixed_from: int


class PatternSource(Protocol):
    """What pattern matching needs from an inventory."""

    path: str

    def has_host(self, name: str) -> bool: ...
    def host_names(self) -> Sequence[str]: ...
    def group_names(self) -> Sequence[str]: ...
    def has_group(self, name: str) -> bool: ...
    def group_order(self, name: str) -> GroupOrder: ...
    def first_localhost(self) -> str | None: ...


@dataclass(frozen=True)
class Selection:
    """The host names a pattern selects, in Ansible's order, and the implicit localhost if named."""

    names: tuple[str, ...]
    implicit_localhost: str | None = None


def split_pattern(pattern: str, where: str | None = None) -> list[str]:
    """The terms of a pattern, as Ansible splits it; an empty term is an error (not skipped)."""
    if not isinstance(pattern, str) or not pattern.strip():
        raise ConfigError("empty host pattern; use 'all' for every host", where)
    if "," in pattern:
        terms = [t.strip() for t in pattern.split(",")]
        for number, term in enumerate(terms, 1):
            if not term or term in ("!", "&"):
                raise ConfigError(f"host pattern {pattern!r}: term {number} of {len(terms)} is empty; "
                                  "a stray ',' would widen or narrow the selection", where)
        return terms
    try:
        parse_address(pattern)
        return [pattern.strip()]
    except NotAnAddress:
        pass
    terms: list[str] = []
    position = 0
    for found in _COLON_TERM.finditer(pattern):
        gap = pattern[position:found.start()]
        separator_ok = gap.strip() == "" if not terms else gap.strip() in ("", ":")
        if not separator_ok:
            raise ConfigError(f"host pattern {pattern!r}: empty term or stray {gap.strip()!r} before "
                              f"{found.group()!r}", where)
        terms.append(found.group())
        position = found.end()
    rest = pattern[position:]
    if rest.strip() or not terms:
        raise ConfigError(f"host pattern {pattern!r}: empty term or stray {rest.strip() or pattern!r} at the end",
                          where)
    for term in terms:
        if term in ("!", "&"):
            raise ConfigError(f"host pattern {pattern!r}: '{term}' with no name after it", where)
    return terms


def split_subscript(term: str, where: str | None = None) -> tuple[str, tuple[int, int | None] | None]:
    """(pattern, (start, end or None)) for `name[N]` / `name[N:M]` / `name[N:]`; regexes have none."""
    if term.startswith("~"):
        return term, None
    found = _SUBSCRIPT.match(term)
    if not found:
        return term, None
    base, index, start, separator, end = found.groups()
    if index is not None:
        return base, (int(index), None)
    if separator == "-":
        # Ansible still applies it (as [x:y]) after warning that the form was removed; a pattern
        # meant as a glob (`web[1-4]`) would then pick positions instead, so refuse it.
        raise ConfigError(f"host pattern term {term!r}: the [x-y] subscript was removed from Ansible; "
                          f"write positions as {base}[{start}:{end}] or a glob character class as "
                          f"a separate term", where)
    return base, (int(start), int(end) if end else -1)


def _matcher(expr: str, where: str | None) -> Callable[[str], object] | None:
    """A name test for a glob or `~regex` term; None for a plain name (looked up directly)."""
    if expr.startswith("~"):
        try:
            return re.compile(expr[1:]).match
        except re.error as exc:
            raise ConfigError(f"bad regex in host pattern term {expr!r}: {exc}", where) from None
    if any(ch in expr for ch in _GLOB_CHARS):
        return re.compile(fnmatch.translate(expr)).match
    return None


def _apply_subscript(names: list[str], unfixed_from: int, subscript: tuple[int, int | None],
                     term: str, where: str | None) -> list[str]:
    start, end = subscript
    count = len(names)
    if end is None or end == 0:  # `[N]`, and Ansible reads `[N:0]` as `[N]` too
        if not -count <= start < count:
            raise ConfigError(f"host pattern term {term!r}: position {start} is out of range "
                              f"({count} host{'s' if count != 1 else ''}, positions 0 to {count - 1})", where)
        first = last = start % count
    else:
        last = count - 1 if end == -1 else min(end, count - 1)
        first = start
        if first > last:
            raise ConfigError(f"host pattern term {term!r} selects no host ({count} hosts, positions "
                              f"0 to {count - 1})", where)
    whole_tail = first <= unfixed_from and last >= count - 1
    if last >= unfixed_from and not whole_tail:
        raise ConfigError(f"host pattern term {term!r}: Ansible does not fix the order of these hosts "
                          f"from position {unfixed_from} on (groups nested under more than one child "
                          "group), so a position there could select other hosts than Ansible; name the "
                          "hosts or the groups instead", where)
    return names[first:last + 1]


def _no_match(term: str, source: PatternSource, empty_groups: list[str]) -> ConfigError:
    tail = "; a term that matches no host is an error here (Ansible ignores it), so a typo cannot change a rollout"
    if empty_groups:
        return ConfigError(f"'{term}' matches only groups without hosts ({', '.join(empty_groups[:5])}){tail}",
                           source.path)
    if ":" in term:
        return ConfigError(f"'{term}' is not a host or group in this inventory: once a pattern has a ',', "
                           f"Ansible splits it on commas only, so ':' does not separate terms there; write "
                           f"'{term.replace(':', ',')}' instead{tail}", source.path)
    names = list(source.group_names()) + list(source.host_names()[:10000])
    close = difflib.get_close_matches(term, names, n=1, cutoff=0.75)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return ConfigError(f"'{term}' is not a host or group in this inventory{hint}{tail}", source.path)


def match_term(term: str, source: PatternSource) -> tuple[list[str], bool]:
    """(host names, names the implicit localhost) for one term without its `!`/`&`."""
    where = source.path
    if not term:
        raise ConfigError("empty term in host pattern", where)
    expr, subscript = split_subscript(term, where)
    test = _matcher(expr, where)
    groups = ([g for g in source.group_names() if test(g)] if test
              else ([expr] if source.has_group(expr) else []))
    names: list[str] = []
    unfixed_from: int | None = None
    for group in groups:
        order = source.group_order(group)
        if unfixed_from is None and order.unfixed_from < len(order.names):
            unfixed_from = len(names) + order.unfixed_from
        names.extend(order.names)
    if not groups or expr.startswith("~") or any(ch in expr for ch in _HOST_SCAN_CHARS):
        if test:
            names.extend(h for h in source.host_names() if test(h))
        elif source.has_host(expr):
            names.append(expr)
    implicit = False
    if not names and expr in LOCALHOST_NAMES:
        # Ansible's implicit localhost, or the inventory's first localhost-like host if it has one
        local = source.first_localhost()
        names, implicit = ([local], False) if local else ([expr], True)
    if not names:
        raise _no_match(term, source, groups)
    if subscript is not None:
        names = _apply_subscript(names, len(names) if unfixed_from is None else unfixed_from,
                                 subscript, term, where)
    return names, implicit


def read_limit_file(term: str, where: str | None) -> list[tuple[str, int]]:
    """The patterns of `@FILE`, one per line, as Ansible's --limit reads them: each stripped line
    is one term (not split further), blank lines skipped. (term, line number) pairs. An empty
    file is refused: Ansible would then limit nothing and run on every host."""
    path = term[1:]
    if not path:
        raise ConfigError("host pattern term '@' names no file; '@FILE' reads patterns from FILE, one per line",
                          where)
    if not os.path.exists(path):
        raise ConfigError(f"limit file {path!r} not found ('@FILE' reads host patterns from FILE, one per line)",
                          where)
    if not os.path.isfile(path):
        raise ConfigError(f"limit file {path!r} is not a file ('@FILE' reads host patterns from FILE, one per "
                          "line)", where)
    terms = [(line.strip(), number) for number, line in enumerate(read_text(path, path, "the limit file")
                                                                 .split("\n"), 1) if line.strip()]
    if not terms:
        raise ConfigError("the limit file names no host pattern; Ansible would then limit nothing and select "
                          "every host", path)
    return terms


def _match_tagged(term: str, source: PatternSource) -> tuple[list[str], bool]:
    """match_term for a term as written (with its `!`/`&`); its errors carry the term."""
    try:
        return match_term(term[1:] if term[0] in "!&" else term, source)
    except ConfigError as exc:
        exc.term = term  # type: ignore[attr-defined]
        raise


def select(pattern: str, source: PatternSource) -> Selection:
    """The hosts `ansible PATTERN --list-hosts` lists, or a ConfigError saying why not. A pattern
    with `@FILE` terms is `ansible all --limit PATTERN`: the file's lines are terms too, and the
    hosts come in the order `all` lists them."""
    terms = split_pattern(pattern, source.path)
    from_files: dict[str, tuple[str, int]] = {}  # a term read from a limit file -> (file, line)
    if any(t.lstrip("!&").startswith("@") for t in terms):
        expanded = []
        for term in terms:
            if term[:2] in ("!@", "&@"):
                raise ConfigError(f"host pattern term {term!r}: a limit file is a term of its own ('@FILE'); "
                                  f"Ansible takes no '{term[0]}' before it: write '{term[0]}' before the lines "
                                  "of the file instead", source.path)
            if not term.startswith("@"):
                expanded.append(term)
                continue
            for line_term, number in read_limit_file(term, source.path):
                from_files.setdefault(line_term, (term[1:], number))
                expanded.append(line_term)
        terms = expanded
    try:
        chosen = _evaluate(pattern, terms, source)
    except ConfigError as exc:
        term = getattr(exc, "term", None)
        if term in from_files:  # point at the line of the limit file that holds it
            raise ConfigError(f"{without_location(exc)} (inventory {source.path})", *from_files[term]) from None
        raise
    if not from_files:
        return chosen
    listed = set(chosen.names)  # Ansible's --limit filters the play's hosts (all), in their order
    names = tuple(n for n in source.group_order("all").names if n in listed)
    if not names:  # only the implicit localhost, which `all` does not hold
        _nothing(pattern, source)
    return Selection(names)


def _nothing(pattern: str, source: PatternSource) -> NoReturn:
    raise ConfigError(f"host pattern '{pattern}' matches no host", source.path)


def _evaluate(pattern: str, terms: list[str], source: PatternSource) -> Selection:
    plain = [t for t in terms if t[0] not in "!&"]
    intersections = [t for t in terms if t[0] == "&"]
    exclusions = [t for t in terms if t[0] == "!"]
    result: dict[str, None] = {}  # an ordered set
    implicit: str | None = None
    for term in plain or ["all"]:
        if source.has_host(term):
            result.setdefault(term, None)
            continue
        names, is_implicit = _match_tagged(term, source)
        if is_implicit:
            implicit = names[0]
        for name in names:
            result.setdefault(name, None)
    for term in intersections:
        keep = set(_match_tagged(term, source)[0])
        result = {n: None for n in result if n in keep}
    for term in exclusions:
        drop = set(_match_tagged(term, source)[0])
        result = {n: None for n in result if n not in drop}
    if not result:
        _nothing(pattern, source)
    if implicit is not None and implicit not in result:
        implicit = None
    return Selection(tuple(result), implicit)
