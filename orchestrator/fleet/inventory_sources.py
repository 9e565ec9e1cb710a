"""Which inventory files Ansible would read: the default source, directories, what is skipped.

- The default source, when neither `-i` nor `SGLFLEET_INVENTORY` names one: `ANSIBLE_INVENTORY`
  (comma-separated, relative to the working directory), else `inventory =` in `[defaults]` of the
  first ansible.cfg Ansible reads (`ANSIBLE_CONFIG`, `./ansible.cfg` unless the directory is
  world-writable, `~/.ansible.cfg`, `/etc/ansible/ansible.cfg`; relative to that file).
- A directory stands for every file in it and below, in sorted order, except hidden names,
  `group_vars`, `host_vars`, `vars_plugins` and Ansible's `INVENTORY_IGNORE_EXTS`
  (`.pyc .pyo .swp .bak ~ .rpm .md .txt .rst .orig .cfg .retry`) and
  `INVENTORY_IGNORE_PATTERNS` (none) — or what `ANSIBLE_INVENTORY_IGNORE`,
  `ANSIBLE_INVENTORY_IGNORE_REGEX` or the ansible.cfg settings make of them.
- A source with a comma that is no path is a host list (`-i 'web1,web2:2222,'`, the host_list plugin).
- What Ansible's other plugins would read (an executable script, TOML) is refused by name.

No file is parsed here; `inventory` reads each one as YAML or INI, as Ansible's plugins would.
"""

from __future__ import annotations

import configparser
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

# ansible-core 2.19, lib/ansible/constants.py REJECT_EXTS and config/base.yml INVENTORY_IGNORE_EXTS
REJECT_EXTS = (".pyc", ".pyo", ".swp", ".bak", "~", ".rpm", ".md", ".txt", ".rst")
IGNORE_EXTS = REJECT_EXTS + (".orig", ".cfg", ".retry")
IGNORE_PATTERNS: tuple[str, ...] = ()
IGNORED_ALWAYS = (r"^\.", "^host_vars$", "^group_vars$", "^vars_plugins$")
YAML_EXTENSIONS = ("", ".yaml", ".yml", ".json")  # the yaml plugin's; any other file goes to ini


@dataclass(frozen=True)
class DefaultSource:
    """The inventory sources Ansible would use without -i, and the setting that named them."""

    paths: tuple[str, ...]
    chosen_by: str


def _unquote(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def _resolve(path: str, basedir: str) -> str:
    """A path as Ansible's config resolves it: `{{CWD}}`, $VARS and ~ expanded, relative to basedir."""
    path = os.path.expanduser(os.path.expandvars(path.replace("{{CWD}}", os.getcwd())))
    return os.path.normpath(os.path.join(basedir, path))


def ansible_cfg() -> str | None:
    """The ansible.cfg Ansible reads: the first that exists of its four places."""
    candidates = []
    env = os.environ.get("ANSIBLE_CONFIG")
    if env is not None:
        env = _resolve(env, os.getcwd())
        candidates.append(os.path.join(env, "ansible.cfg") if os.path.isdir(env) else env)
    try:
        cwd = os.getcwd()
        if not os.stat(cwd).st_mode & stat.S_IWOTH:  # Ansible skips a world-writable directory's
            candidates.append(os.path.join(cwd, "ansible.cfg"))
    except OSError:
        pass
    candidates += [os.path.expanduser("~/.ansible.cfg"), "/etc/ansible/ansible.cfg"]
    for path in candidates:
        if os.path.exists(path) and os.access(path, os.R_OK):
            return path
    return None


def _read_cfg(path: str) -> configparser.ConfigParser:
    if os.path.splitext(path)[1] not in (".cfg", ".ini"):
        raise ConfigError("Ansible reads only .cfg or .ini config files (from ANSIBLE_CONFIG)", path)
    parser = configparser.ConfigParser(inline_comment_prefixes=(";",), interpolation=None)
    try:
        parser.read_string(Path(path).read_text(encoding="utf-8"), source=path)
    except (configparser.Error, UnicodeDecodeError, OSError) as exc:
        message = str(exc).replace("\n", " ")
        raise ConfigError(f"cannot read this Ansible config file: {message}", path) from None
    return parser


def _cfg_list(parser: configparser.ConfigParser, entries: tuple[tuple[str, str], ...]) -> list[str] | None:
    """A list setting from the config; of several (section, key) entries the last one set wins."""
    found = None
    for section, key in entries:
        if parser.has_option(section, key):
            found = [_unquote(x.strip()) for x in _unquote(parser.get(section, key).strip()).split(",")]
    return found


def default_source() -> DefaultSource | None:
    """ANSIBLE_INVENTORY, else the first ansible.cfg's `inventory =`; None when neither is set."""
    env = os.environ.get("ANSIBLE_INVENTORY")
    if env:
        paths = tuple(_resolve(p.strip(), os.getcwd()) for p in env.split(",") if p.strip())
        return DefaultSource(paths, "ANSIBLE_INVENTORY") if paths else None
    cfg = ansible_cfg()
    if cfg is None:
        return None
    listed = _cfg_list(_read_cfg(cfg), (("defaults", "inventory"),))
    if not listed or not any(listed):
        return None
    basedir = os.path.dirname(os.path.abspath(cfg))
    return DefaultSource(tuple(_resolve(p, basedir) for p in listed if p), f"inventory = in {cfg}")


def _ignore_setting(env_name: str, entries: tuple[tuple[str, str], ...], default: tuple[str, ...]) -> list[str]:
    env = os.environ.get(env_name)
    if env is not None:
        return [x.strip() for x in env.split(",") if x.strip()]
    cfg = ansible_cfg()
    found = _cfg_list(_read_cfg(cfg), entries) if cfg else None
    return [x for x in found if x] if found is not None else list(default)


def ignored_names() -> re.Pattern[str]:
    """The names Ansible skips in an inventory directory (hidden, vars dirs, ignored exts/patterns)."""
    exts = _ignore_setting("ANSIBLE_INVENTORY_IGNORE", (("defaults", "inventory_ignore_extensions"),
                                                        ("inventory", "ignore_extensions")), IGNORE_EXTS)
    patterns = _ignore_setting("ANSIBLE_INVENTORY_IGNORE_REGEX", (("defaults", "inventory_ignore_patterns"),
                                                                  ("inventory", "ignore_patterns")), IGNORE_PATTERNS)
    try:
        return re.compile("|".join([*IGNORED_ALWAYS, *patterns, *(re.escape(x) + "$" for x in exts)]))
    except re.error as exc:
        raise ConfigError(f"an inventory ignore pattern is not a valid regex: {exc}") from None


def inventory_files(source: str | Path) -> list[Path]:
    """The files a source stands for: itself, or a directory's files in Ansible's order."""
    path = Path(source)
    if not path.is_dir():
        return [path]
    ignored = ignored_names()
    found: list[Path] = []

    def walk(directory: Path) -> None:
        for name in sorted(os.listdir(directory), key=os.fsencode):  # Ansible sorts the bytes
            if ignored.search(name):
                continue
            full = directory / name
            if full.is_dir():
                walk(full)
            else:
                found.append(full)
    walk(path)
    if not found:
        raise ConfigError("this inventory directory holds no file Ansible would read as an inventory "
                          "(hidden files, group_vars/, host_vars/ and ignored extensions are skipped)", str(path))
    return found


def is_host_list(source: str | Path) -> bool:
    """`-i 'web1,web2,'`: what Ansible's host_list plugin takes (a comma, and no such path)."""
    return isinstance(source, str) and "," in source and not os.path.exists(source)


def refuse_other_plugins(path: Path, shown: str) -> None:
    """Files only Ansible's script or toml plugin reads: refused, naming the construct."""
    if path.suffix == ".toml":
        raise ConfigError("a TOML inventory (Ansible's toml plugin); sglfleet reads YAML and INI inventories: "
                          "convert it with `ansible-inventory -i FILE --list -y > inventory.yaml`", shown, 1)
    if os.access(path, os.X_OK) and path.is_file():
        with open(path, "rb") as handle:
            if handle.read(2) == b"#!":
                raise ConfigError("an executable inventory script (Ansible would run it); sglfleet runs no "
                                  "inventory scripts: save what it lists with `ansible-inventory -i FILE "
                                  "--list -y > inventory.yaml` and use that", shown, 1)


def reads_as_yaml(path: Path) -> bool:
    """Whether Ansible's yaml plugin tries the file (by its extension) before the ini plugin."""
    return os.path.splitext(path.name)[1] in YAML_EXTENSIONS
