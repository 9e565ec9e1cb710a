"""Render a profile for one host: the launch argv (with where each flag came from), env file, unit.

    server facts (one round trip: SGLang version + accepted flags, model/draft config, GPUs)
    -> rules (profile values, the hybrid rule, extra args) -> flags with their source
    -> checked against the flags the host's SGLang accepts -> templates/*.j2
"""

from __future__ import annotations

import difflib
import shlex
from dataclasses import dataclass, field
from typing import Any

import jinja2

from ..data import data_dir
from ..errors import SglfleetError
from ..fleet.inventory import Host
from ..spec.profile import Profile, with_overrides
from ..fleet.remote_call import call

TEMPLATES = data_dir("templates")

# Flags SGLang renamed: old spelling -> (new spelling, what changed).
RENAMED = {
    "--mamba-scheduler-strategy": ("--mamba-radix-cache-strategy",
                                   "the mamba cache strategy flag was renamed; its values (auto, no_buffer, "
                                   "extra_buffer) are the same"),
}
HYBRID_MEMORY_RATIO = "0.5"


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

    @property
    def argv(self) -> list[str]:
        return [arg for flag in self.flags for arg in flag.argv]

    @property
    def command(self) -> list[str]:
        return [self.python, "-m", "sglang.launch_server", *self.argv]

    def template(self, name: str, **extra: Any) -> str:
        return environment().get_template(name).render(r=self, **extra)

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "profile": self.profile, "command": self.command,
                "command_line": shlex.join(self.command), "env": self.env,
                "flags": [{"flag": f.name, "values": f.values, "source": f.source} for f in self.flags],
                "sglang": self.facts["sglang"].get("version"),
                "model": self.facts.get("model"), "draft": self.facts.get("draft")}


def environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, autoescape=False)
    # The one place values become shell text: each argument quoted exactly once.
    env.filters["shell_join"] = shlex.join
    env.filters["shell_quote"] = shlex.quote
    return env


def server_facts(conn: Any, profile: Profile) -> dict[str, Any]:
    """One round trip: remote/server_facts.py on conn's host (a LocalConnection for --local)."""
    model = profile.model.model
    spec = profile.model.speculative
    args = {"model": model.path if model else None, "draft": spec.draft_model if spec else None}
    return call(conn, "server_facts.py", "facts", args, timeout=300)


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
            return f"{self.where} (profile_overrides.{dotted})"
        node, line = self.profile.source, None
        for key in keys:
            if not hasattr(node, "line_of") or key not in node:
                break
            line, node = node.line_of(key), node[key]
        where = f"{self.profile.path}:{line}" if line else f"{self.profile.path} (default)"
        return f"{where} ({dotted})"


def render(host: Host, profile: Profile, facts: dict[str, Any], inventory_path: str = "inventory") -> Rendered:
    overrides = (host.vars.get("profile_overrides") or {}).get(profile.name)
    where = f"{inventory_path} ({host.name})"
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
    flags = [Flag("--model-path", [p.model.path], src("model", "path"))]
    if p.model.served_name:
        flags.append(Flag("--served-model-name", [p.model.served_name], src("model", "served_name")))
    flags += [Flag("--host", [p.server.host], src("server", "host")),
              Flag("--port", [str(p.server.port)], src("server", "port")),
              Flag("--tp-size", [str(p.server.tp)], src("server", "tp"))]
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
    flags += _hybrid_flags(p, model, sglang.get("options") or [], src)
    flags += _extra_flags(p.server.extra_args, src("server", "extra_args"))
    _check_known(host.name, flags, sglang)
    return Rendered(host.name, p.name, host.python, flags, dict(p.env), facts)


def _hybrid_flags(p: Any, model: dict[str, Any], options: list[str], src: _Sources) -> list[Flag]:
    if p.hybrid == "off" or (p.hybrid == "auto" and not model.get("hybrid")):
        return []
    arch = (model.get("architectures") or ["?"])[0]
    why = (f"hybrid rule (hybrid: {p.hybrid}; {arch} has {model.get('recurrent_layers')} "
           f"linear-attention layers), {src('hybrid')}")
    # The strategy flag under the name this SGLang accepts (it was renamed).
    strategy = next((f for f in ("--mamba-radix-cache-strategy", "--mamba-scheduler-strategy") if f in options),
                    "--mamba-radix-cache-strategy")
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
