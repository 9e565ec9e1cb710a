"""Destinations OpenSSH provably answers alike, but for their own name: one `ssh -G` for many.

Job: split the destinations of one ssh command line (the same options, the same config) into
classes whose `ssh -G` answers can only differ by the destination itself, and tell, from two
answers of a class, whether the others' follow from them. Policy-free: fleet/ssh_resolve.py runs
`ssh -G` and decides what to do with a verdict.

Why it is exact. Reading its config for a destination D, ssh (readconf.c, ssh.c) depends on D in
these places only: `Host` patterns and `Match host`/`originalhost` criteria are matched against D
(or against the HostName once one is set), `Match exec` runs a command with D in it, HostName
and other values expand %h/%n, and canonicalization looks D up in DNS. So:

- Only destinations made of [a-z0-9._-] take part (no user@, port, IPv6 or ssh:// forms, no
  case for ssh to fold, no token character).
- Every pattern of every Host line and Match line in every file ssh read is matched against D
  with ssh's own wildcard rules (`*`, `?`, nothing else; as written and lowercased, since `Match
  host` lowercases its patterns). Destinations with the same results on all of them take the same
  path through the config: the same blocks apply, the same files are included, the same values
  are taken first. A class is the destinations with the same results.
- Anything this reading cannot vouch for keeps the class out: a Match criterion other than all,
  canonical, final, host, originalhost, user, localuser (exec runs D; others are newer than this
  reading), an Include whose path has a token or a variable, a quote on a Host or Match line, and
  answers with canonicalization on or a Match exec met.
- Two destinations A and B of a class are asked. Their answers must read the same files and
  apply the same blocks, agree on every value sglfleet reads but `host` and `hostname`, say
  `host` A and B, and say `hostname` either the same for both (a HostName without %h: the same
  for every member) or A and B themselves (no HostName, or exactly %h: since A != B, a template
  that yields A for A and B for B is %h alone). Values ssh prints unexpanded (IdentityFile,
  ProxyCommand) are expanded per host afterwards, as for any answer. Then every other member's
  answer is A's with its own name in `host` (and in `hostname` when that is the destination).
  A class whose two answers disagree otherwise is asked host by host, as before.

Checked against ssh -G itself, destination by destination: tests/test_ssh_alike.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

# Destinations that take part: nothing ssh would fold, split or expand.
_PLAIN_DESTINATION = re.compile(r"[a-z0-9][a-z0-9._-]*")
_KEYWORD = re.compile(r"^\s*([A-Za-z]+)\s*(?:=\s*|\s+)(.*)$")
# Match criteria whose arguments are patterns (matched against D, the user, the local user) and
# those without an argument; any other criterion keeps the file's destinations out.
_PATTERN_CRITERIA = frozenset({"host", "originalhost", "user", "localuser"})
_BARE_CRITERIA = frozenset({"all", "canonical", "final"})
# What must agree between the two asked members besides `host`/`hostname` (the settings sglfleet
# reads, as the answer cache keeps them).
NAMED = ("host", "hostname")


@dataclass(frozen=True)
class Patterns:
    """Every Host/Match pattern of a set of config files, as matchers."""

    compiled: tuple[re.Pattern[str], ...]


def plain(destination: str) -> bool:
    return _PLAIN_DESTINATION.fullmatch(destination) is not None


def _matcher(pattern: str) -> re.Pattern[str]:
    """OpenSSH's match_pattern: `*` any run of characters, `?` any one, the rest literally."""
    return re.compile("".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern), re.S)


def config_patterns(texts: Iterable[str]) -> Patterns | None:
    """The patterns of these config files' Host and Match lines, or None when one of them is
    beyond this reading (see the module docstring)."""
    words: set[str] = set()
    for text in texts:
        for line in text.splitlines():
            m = _KEYWORD.match(line)
            if not m or line.lstrip().startswith("#"):
                continue
            keyword, rest = m.group(1).lower(), m.group(2).split("#", 1)[0]
            if keyword == "include":
                if "%" in rest or "$" in rest:
                    return None
                continue
            if keyword not in ("host", "match"):
                continue
            if '"' in rest or "'" in rest:
                return None
            tokens = rest.split()
            if keyword == "host":
                words.update(tokens)
                continue
            index = 0
            while index < len(tokens):
                criterion = tokens[index].lower().lstrip("!")
                if criterion in _BARE_CRITERIA:
                    index += 1
                elif criterion in _PATTERN_CRITERIA and index + 1 < len(tokens):
                    words.update(tokens[index + 1].split(","))
                    index += 2
                else:
                    return None  # exec (runs D), or a criterion newer than this reading
    patterns = set()
    for word in words:
        word = word.lstrip("!")
        patterns.update((word, word.lower()))
    return Patterns(tuple(_matcher(p) for p in sorted(patterns)))


def signature(destination: str, patterns: Patterns) -> tuple[bool, ...]:
    """Which of the patterns `destination` matches: equal signatures, equal paths through the config."""
    return tuple(m.fullmatch(destination) is not None for m in patterns.compiled)


def alike(a: str, values_a: dict[str, list[str]], b: str, values_b: dict[str, list[str]],
          keys: Iterable[str]) -> str | None:
    """How `hostname` follows for every member of a class whose members `a` and `b` were answered
    so: "same" (one value for all) or "destination" (each its own name); None when the two
    answers do not show a class that differs by the name only."""
    if a == b or values_a.get("host") != [a] or values_b.get("host") != [b]:
        return None
    if values_a.get("canonicalizehostname") != ["false"] or values_b.get("canonicalizehostname") != ["false"]:
        return None
    if any(values_a.get(k) != values_b.get(k) for k in keys if k not in NAMED):
        return None
    if values_a.get("hostname") == values_b.get("hostname"):
        return "same"
    if values_a.get("hostname") == [a] and values_b.get("hostname") == [b]:
        return "destination"
    return None


def answer_for(destination: str, values: dict[str, list[str]], hostname: str) -> dict[str, Any]:
    """A member's answer from the class's: its own name where the destination goes."""
    derived = {k: list(v) for k, v in values.items()}
    derived["host"] = [destination]
    if hostname == "destination":
        derived["hostname"] = [destination]
    return derived
