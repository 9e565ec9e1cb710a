"""Render a profile for one host: the launch argv (with where each flag came from), env file, unit.

    server facts (one round trip: SGLang version + accepted flags, model/draft config, GPUs)
    -> rules (profile values, the hybrid rule, extra args) -> flags with their source
    -> checked against the flags the host's SGLang accepts -> templates/*.j2

Host vars that change what runs (inventory; `lab up` writes both for lab hosts):
    sglfleet_server_bind     the address this host's server binds, over the profile's server.host
    sglfleet_server_command  what runs instead of `PYTHON -m sglang.launch_server` (a list or a string),
                    e.g. the lab's stand-in; shown as such in the launch script and in `render`

Every value reaches the files through one filter per format: `shell_quote`/`shell_join` (the
launch script and the env file, which a shell and systemd's EnvironmentFile both read),
`systemd_exec`/`systemd_text` (the unit), `comment` (one line of a comment, in any of them).
"""

from __future__ import annotations

import difflib
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

import jinja2

from ..data import data_dir
from ..errors import SglfleetError
from ..fleet.inventory import Host
from ..spec.profile import Profile, with_overrides
from ..fleet.remote_call import call
from ..remote import redact
from . import sglang_options
from .units import Placement

TEMPLATES = data_dir("templates")

# Flags SGLang renamed: old spelling -> (new spelling, what changed).
RENAMED = {
    "--mamba-scheduler-strategy": ("--mamba-radix-cache-strategy",
                                   "the mamba cache strategy flag was renamed; its values (auto, no_buffer, "
                                   "extra_buffer) are the same"),
}
HYBRID_MEMORY_RATIO = "0.5"
WILDCARD_BINDS = ("0.0.0.0", "::", "[::]")
SGLANG_LAUNCHER = ("-m", "sglang.launch_server")


class RenderError(SglfleetError):
    exit_code = 2


@dataclass
class Flag:
    name: str               # "--port"
    values: list[str]       # ["30000"]; [] for a switch
    source: str             # "playbooks/x.yaml:12 (server.port)" or "hybrid rule: ..."

    @property
    def argv(self) -> list[str]:
        return [self.name, *self.values]


@dataclass
class Rendered:
    host: str
    profile: str
    python: str
    flags: list[Flag]
    env: dict[str, str]
    facts: dict[str, Any] = field(repr=False)
    # What runs the flags: [python, -m, sglang.launch_server] unless the inventory's
    # sglfleet_server_command says otherwise (the lab's stand-in), with where that came from.
    launcher: list[str] | None = None
    launcher_source: str = "SGLang (python -m sglang.launch_server)"
    bind: str = "127.0.0.1"
    port: int = 30000
    placement: Placement | None = None  # its rank in a multi-node server (None: it serves alone)

    @property
    def rank(self) -> int:
        """Its --node-rank; 0 also for a server of one node (it serves HTTP either way)."""
        return self.placement.rank if self.placement else 0

    @property
    def argv(self) -> list[str]:
        return [arg for flag in self.flags for arg in flag.argv]

    @property
    def command(self) -> list[str]:
        return [*(self.launcher or [self.python, *SGLANG_LAUNCHER]), *self.argv]

    def template(self, name: str, **extra: Any) -> str:
        return environment().get_template(name).render(r=self, **extra)

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "profile": self.profile, "command": self.command,
                "command_line": shlex.join(self.command), "env": self.env, "launcher": self.launcher_source,
                "bind": self.bind, "port": self.port,
                "flags": [{"flag": f.name, "values": f.values, "source": f.source} for f in self.flags],
                "sglang": self.facts["sglang"].get("version"),
                # where the option list the flags were checked against came from: the host's
                # cache, the controller's (stages/sglang_options.py), or "listed" (SGLang imported)
                "options": {"fingerprint": self.facts["sglang"].get("options_fingerprint"),
                            "from": self.facts["sglang"].get("options_cached") or "listed"},
                "model": self.facts.get("model"), "draft": self.facts.get("draft"),
                **({"placement": self.placement.to_json()} if self.placement else {})}


def environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, autoescape=False)
    # The one place values become shell text: each argument quoted exactly once.
    env.filters["shell_join"] = shlex.join
    env.filters["shell_quote"] = shlex.quote
    env.filters["systemd_exec"] = systemd_exec
    env.filters["systemd_text"] = systemd_text
    env.filters["comment"] = comment
    env.filters["env_key"] = env_key
    return env


def env_key(key: str) -> str:
    # The profile schema checks keys too; a template never writes one that could run as code.
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        raise RenderError(f"env key {key!r} is not a variable name ([A-Za-z_][A-Za-z0-9_]*)")
    return key


def comment(value: Any) -> str:
    """Free text on one comment line of any of the files: line breaks and other control
    characters are shown escaped, so text can never end the comment and become a line of its own."""
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in str(value))


SAFE_EXECUTABLE = re.compile(r"/[A-Za-z0-9/._+-]+")


def systemd_exec(argv: list[str]) -> str:
    """An ExecStart= command line. The executable must be a plain absolute path (systemd refuses
    "special characters" there and expands nothing in it); each argument goes in double quotes
    with systemd's C-style escapes, `%` doubled (specifiers) and `$` doubled (variable
    expansion); see systemd.service(5)."""
    argv = [str(word) for word in argv]  # a StrictUndefined raises here, as an undefined should
    if not argv or not SAFE_EXECUTABLE.fullmatch(argv[0]):
        raise RenderError(f"a systemd ExecStart= executable must be a plain absolute path, got {argv[:1]!r}")
    return " ".join([argv[0], *(_systemd_word(word) for word in argv[1:])])


def _systemd_word(word: str) -> str:
    out = []
    for c in word:
        if c in '\\"':
            out.append("\\" + c)
        elif c == "%":
            out.append("%%")
        elif c == "$":
            out.append("$$")
        elif not c.isprintable() or c in "\t\n":
            out.append("".join(f"\\x{b:02x}" for b in c.encode("utf-8")))
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def systemd_text(value: Any) -> str:
    """A free-text setting (Description=): specifiers doubled, control characters escaped."""
    return comment(value).replace("%", "%%")


def server_facts(conn: Any, profile: Profile) -> dict[str, Any]:
    """One round trip: remote/server_facts.py on conn's host (a LocalConnection for --local)."""
    model = profile.model.model
    spec = profile.model.speculative
    args = {"model": model.path if model else None, "draft": spec.draft_model if spec else None,
            "known_options": sglang_options.known()}
    return sglang_options.complete(call(conn, "server_facts.py", "facts", args, timeout=300))


class _Sources:
    """Where a profile value came from: file:line, or the inventory override that set it."""

    def __init__(self, profile: Profile, overrides: dict[str, Any] | None, override_where: str):
        self.profile, self.overrides, self.where = profile, overrides or {}, override_where

    def __call__(self, *keys: str) -> str:
        dotted = ".".join(keys)
        node: Any = self.overrides
        for key in keys:
            node = node.get(key) if isinstance(node, dict) else None
        if node is not None:
            return f"{self.where} (sglfleet_profile_overrides.{dotted})"
        node, line = self.profile.source, None
        for key in keys:
            if not hasattr(node, "line_of") or key not in node:
                break
            line, node = node.line_of(key), node[key]
        where = f"{self.profile.path}:{line}" if line else f"{self.profile.path} (default)"
        return f"{where} ({dotted})"


def render(host: Host, profile: Profile, facts: dict[str, Any], inventory_path: str = "inventory",
           check_flags: bool = True, placement: Placement | None = None) -> Rendered:
    """The launch command and files for `host`. `check_flags=False` skips the check against the
    flags the host's SGLang accepts NOW: deploy renders before it pushes the patchset that adds
    flags, and the smoke probe then runs SGLang's own parser on the pushed code. `placement`: the
    host's rank in a multi-node server (stages.units), required when the profile's nodes > 1."""
    all_overrides = host.vars.get("sglfleet_profile_overrides") or {}
    where = f"{inventory_path} ({host.name})"
    if not isinstance(all_overrides, dict):
        raise RenderError(f"{where}: sglfleet_profile_overrides must be a mapping of profile names to overrides "
                          f"(sglfleet_profile_overrides: {{{profile.name}: {{server: {{port: 30001}}}}}}), "
                          f"got a {type(all_overrides).__name__}")
    overrides = all_overrides.get(profile.name)
    profile = with_overrides(profile, overrides, where)
    src = _Sources(profile, overrides, where)
    p = profile.model
    sglang = facts["sglang"]
    if not sglang.get("installed"):
        raise RenderError(f"{host.name}: SGLang is not installed for {facts.get('python')}")
    if p.model is None:
        raise RenderError(f"profile {p.name} has no model section; nothing to launch")
    model = facts.get("model") or {}
    if not model.get("exists"):
        raise RenderError(f"{host.name}: model path {p.model.path} does not exist on the host "
                          f"(from {src('model', 'path')})")
    draft = facts.get("draft")
    if p.speculative and draft is not None and not draft.get("exists"):
        raise RenderError(f"{host.name}: draft model {p.speculative.draft_model} does not exist on the host "
                          f"(from {src('speculative', 'draft_model')}); copy the draft there or fix "
                          "speculative.draft_model (SGLang would read the path as a Hugging Face repo id and "
                          "fail with an unrelated 'Repo id' error)")
    bind, bind_source = _bind(host, p, src, inventory_path)
    flags = [Flag("--model-path", [p.model.path], src("model", "path"))]
    if p.model.served_name:
        flags.append(Flag("--served-model-name", [p.model.served_name], src("model", "served_name")))
    flags += [Flag("--host", [bind], bind_source),
              Flag("--port", [str(p.server.port)], src("server", "port")),
              Flag("--tp-size", [str(p.server.tp)], src("server", "tp"))]
    flags += _parallel_flags(host, p, src, placement)
    if p.server.mem_fraction is not None:
        flags.append(Flag("--mem-fraction-static", [str(p.server.mem_fraction)], src("server", "mem_fraction")))
    spec = p.speculative
    if spec:
        flags += [Flag("--speculative-algorithm", [spec.algorithm], src("speculative", "algorithm")),
                  Flag("--speculative-draft-model-path", [spec.draft_model], src("speculative", "draft_model"))]
        if spec.block_size is not None:
            flags.append(Flag("--speculative-dflash-block-size", [str(spec.block_size)],
                              src("speculative", "block_size")))
        if spec.algorithm == "DDTREE" and spec.ddtree:
            d = spec.ddtree
            flags.append(Flag("--speculative-ddtree-budget", [str(d.budget)], src("speculative", "ddtree", "budget")))
            if d.topk_cap is not None:
                flags.append(Flag("--speculative-ddtree-topk-cap", [str(d.topk_cap)],
                                  src("speculative", "ddtree", "topk_cap")))
            if d.shadow_linear:
                flags.append(Flag("--speculative-ddtree-shadow-linear", [],
                                  src("speculative", "ddtree", "shadow_linear")))
    flags += _hybrid_flags(p, model, sglang, src)
    flags += _extra_flags(p.server.extra_args, src("server", "extra_args"))
    if check_flags:
        _check_known(host.name, flags, sglang)
    launcher, launcher_source = _launcher(host, inventory_path)
    rendered = Rendered(host.name, p.name, host.python, flags, dict(p.env), facts, launcher, launcher_source, bind,
                        p.server.port, placement if p.server.nodes > 1 else None)
    redact.remember(rendered.command, rendered.env)  # nothing this process prints or stores shows them
    return rendered


def _parallel_flags(host: Host, p: Any, src: _Sources, placement: Placement | None) -> list[Flag]:
    """--pp-size, and for a server over several nodes this rank's --nnodes, --node-rank and
    --dist-init-addr (every rank gets the same model, tp and pp)."""
    flags = [Flag("--pp-size", [str(p.server.pp)], src("server", "pp"))] if p.server.pp > 1 else []
    if p.server.nodes == 1:
        return flags
    if placement is None:
        raise RenderError(f"{host.name}: profile {p.name} runs on {p.server.nodes} nodes ({src('server', 'nodes')}); "
                          "its ranks are rendered from their server group (sglfleet_server_group)")
    return flags + [Flag("--nnodes", [str(placement.nodes)], placement.sources.get("--nnodes", src("server", "nodes"))),
                    Flag("--node-rank", [str(placement.rank)], placement.sources.get("--node-rank", "?")),
                    Flag("--dist-init-addr", [placement.dist_init_addr], placement.sources.get("--dist-init-addr", "?"))]


def _bind(host: Host, p: Any, src: _Sources, inventory_path: str) -> tuple[str, str]:
    """The address the server binds: the host's sglfleet_server_bind over the profile's server.host.
    Lab hosts share one network namespace, so a wildcard bind there is refused."""
    bind, source = p.server.host, src("server", "host")
    if host.vars.get("sglfleet_server_bind"):
        bind, source = str(host.vars["sglfleet_server_bind"]), f"{inventory_path} ({host.name}: sglfleet_server_bind)"
    if "sglfleet_lab_gpu" in host.vars and bind in WILDCARD_BINDS:
        raise RenderError(f"{host.name} is a lab host and would bind {bind} (from {source}): lab hosts share one "
                          f"network namespace, so {bind}:{p.server.port} would take the port on every lab address "
                          f"at once. Each lab host binds its own address: set sglfleet_server_bind: {host.address} on it "
                          f"(`sglfleet lab up` writes it; an inventory from an older lab lacks it)")
    return bind, source


def _launcher(host: Host, inventory_path: str) -> tuple[list[str] | None, str]:
    command = host.vars.get("sglfleet_server_command")
    if not command:
        return None, "SGLang (python -m sglang.launch_server)"
    argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
    if not argv:
        raise RenderError(f"{inventory_path} ({host.name}): sglfleet_server_command is empty")
    label = str(host.vars.get("sglfleet_server_command_label") or "sglfleet_server_command")
    return argv, f"{inventory_path} ({host.name}: sglfleet_server_command): {label}"


MAMBA_STRATEGY_FLAGS = ("--mamba-radix-cache-strategy", "--mamba-scheduler-strategy")  # new name first


def mamba_strategy_flag(sglang: dict[str, Any]) -> str:
    """The mamba cache strategy flag under the name this SGLang accepts (it was renamed); when it
    accepts both, the one it documents (the other is a help-suppressed alias), else the new one."""
    options = sglang.get("options") or []
    undocumented = set(sglang.get("undocumented") or [])
    accepted = [f for f in MAMBA_STRATEGY_FLAGS if f in options]
    documented = [f for f in accepted if f not in undocumented]
    return (documented or accepted or [MAMBA_STRATEGY_FLAGS[0]])[0]


def _hybrid_flags(p: Any, model: dict[str, Any], sglang: dict[str, Any], src: _Sources) -> list[Flag]:
    if p.hybrid == "off" or (p.hybrid == "auto" and not model.get("hybrid")):
        return []
    arch = (model.get("architectures") or ["?"])[0]
    why = (f"hybrid rule (hybrid: {p.hybrid}; {arch} has {model.get('recurrent_layers')} "
           f"linear-attention layers), {src('hybrid')}")
    strategy = mamba_strategy_flag(sglang)
    flags = [Flag(strategy, ["extra_buffer"], why), Flag("--mamba-full-memory-ratio", [HYBRID_MEMORY_RATIO], why)]
    if p.speculative and p.speculative.algorithm == "DDTREE":
        flags.append(Flag("--speculative-ddtree-allow-hybrid-unsafe", [], why))
    return flags


def _extra_flags(extra: list[str], source: str) -> list[Flag]:
    flags: list[Flag] = []
    for token in extra:
        if token.startswith("--"):
            name, eq, value = token.partition("=")
            flags.append(Flag(name, [value] if eq else [], source))
        elif flags:
            flags[-1].values.append(token)
        else:
            raise RenderError(f"{source}: extra_args must start with a flag, got {token!r}")
    return flags


def _check_known(host: str, flags: list[Flag], sglang: dict[str, Any]) -> None:
    options = sglang.get("options")
    if options is None:
        raise RenderError(f"{host}: could not list the flags SGLang {sglang.get('version')} accepts:\n"
                          f"{sglang.get('options_error')}")
    known = set(options)
    for flag in flags:
        if flag.name in known:
            continue
        version = sglang.get("version")
        if flag.name in RENAMED and RENAMED[flag.name][0] in known:
            new, what = RENAMED[flag.name]
            raise RenderError(f"{host}: {flag.name} (from {flag.source}) is not accepted by SGLang {version}: "
                              f"{what}; use {new}")
        close = difflib.get_close_matches(flag.name, sorted(known), n=1, cutoff=0.6)
        hint = f"; the closest flag it knows is {close[0]}" if close else ""
        ddtree = " (the DDTree flags come with the DDTree patchset: sglfleet push HOST PROFILE)" \
            if flag.name.startswith("--speculative-ddtree") else ""
        raise RenderError(f"{host}: {flag.name} (from {flag.source}) is not a flag SGLang {version} accepts"
                          f"{hint}{ddtree}")
