"""Deployment profiles (`playbooks/<name>.yaml`): what to deploy and how to serve it.

Artifact paths (the patchset, the built extension: files on this machine) are relative to the
profile file. Host paths (model.path, speculative.draft_model) must be absolute: the server's
working directory on the host is nobody's choice, so a relative one is refused at load (file:line).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .artifacts import Extension, load_extension
from ..data import data_dir
from ..errors import ConfigError
from .patchset import Patchset, load_patchset
from .yamlsrc import SourceMap, load_model

# A profile name becomes a file name, a systemd unit name and shell text on hosts: a safe slug.
# Both patterns are matched whole (re.fullmatch): `$` alone would let a trailing newline through.
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}"
# An env file key is a shell variable name (sourced with `set -a; .`) and a systemd one.
ENV_KEY_PATTERN = r"[A-Za-z_][A-Za-z0-9_]*"


def _no_nul(value: str, what: str) -> str:
    # NUL cannot travel in an argv, an env file or a unit; everything else is quoted per format.
    if "\0" in value:
        raise ValueError(f"{what} contains a NUL character")
    return value


def _host_path(value: str, what: str) -> str:
    _no_nul(value, what)
    if not value.startswith("/"):
        raise ValueError(f"{what} {value!r} must be an absolute path on the host (it would be read relative to "
                         "the server's working directory there)")
    return value


class ExtensionRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str
    # optional: a missing build is a note on the plan, not an error (CI builds CPU-only).
    optional: bool = False


class ArtifactsRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    patchset: str | None = None
    extension: ExtensionRef | None = None


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(min_length=1)
    served_name: str | None = None

    @field_validator("path")
    @classmethod
    def _path(cls, value: str) -> str:
        return _host_path(value, "model.path")

    @field_validator("served_name")
    @classmethod
    def _text(cls, value: str | None) -> str | None:
        return value if value is None else _no_nul(value, "the value")


class DDTreeSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # The tree's node budget and the per-node top-k cap: positive, and the cap within the budget.
    budget: int = Field(64, ge=1, le=4096)
    topk_cap: int | None = Field(None, ge=1)
    shadow_linear: bool = False

    @model_validator(mode="after")
    def _cap_within_budget(self) -> "DDTreeSettings":
        if self.topk_cap is not None and self.topk_cap > self.budget:
            raise ValueError(f"topk_cap ({self.topk_cap}) cannot exceed budget ({self.budget})")
        return self


class Speculative(BaseModel):
    model_config = ConfigDict(extra="forbid")
    algorithm: Literal["DDTREE", "DFLASH"]
    draft_model: str = Field(min_length=1)
    block_size: int | None = Field(None, ge=1, le=1024)
    ddtree: DDTreeSettings | None = None

    @field_validator("draft_model")
    @classmethod
    def _text(cls, value: str) -> str:
        return _host_path(value, "speculative.draft_model")


class Server(BaseModel):
    model_config = ConfigDict(extra="forbid")
    host: str = Field("127.0.0.1", min_length=1)
    port: int = Field(30000, ge=1, le=65535)
    # Parallelism of the whole server: tp x pp GPUs over `nodes` hosts (a server group of that
    # many hosts in the inventory when nodes > 1: fleet/server_groups.py), each rank reaching
    # rank 0 at its address and dist_init_port (SGLang's --dist-init-addr).
    tp: int = Field(1, ge=1, le=1024)
    pp: int = Field(1, ge=1, le=1024)
    nodes: int = Field(1, ge=1, le=1024)
    dist_init_port: int | None = Field(None, ge=1, le=65535, validate_default=True)
    mem_fraction: float | None = Field(None, gt=0, le=1)
    extra_args: list[str] = []

    @field_validator("nodes")
    @classmethod
    def _nodes(cls, value: int, info: Any) -> int:
        tp, pp = info.data.get("tp"), info.data.get("pp")
        if tp is not None and pp is not None and (tp * pp) % value:
            raise ValueError(f"tp x pp ({tp} x {pp} = {tp * pp} GPUs) must divide evenly over nodes ({value}): "
                             "every node runs the same number of GPUs (SGLang refuses it too)")
        return value

    @field_validator("dist_init_port")
    @classmethod
    def _dist_init_port(cls, value: int | None, info: Any) -> int | None:
        nodes = info.data.get("nodes")
        if nodes is not None and nodes > 1 and value is None:
            raise ValueError(f"a server over {nodes} nodes needs dist_init_port: the port on rank 0's address "
                             "where the ranks meet (SGLang's --dist-init-addr RANK0:PORT); every node must reach it")
        if value is not None and value == info.data.get("port"):
            raise ValueError(f"dist_init_port {value} is server.port too; rank 0 serves HTTP there")
        return value

    @property
    def gpus_per_node(self) -> int:
        return self.tp * self.pp // self.nodes

    @field_validator("host")
    @classmethod
    def _host(cls, value: str) -> str:
        if any(c.isspace() for c in value) or "\0" in value:
            raise ValueError(f"server.host must be one address, got {value!r}")
        return value

    @field_validator("extra_args")
    @classmethod
    def _args(cls, value: list[str]) -> list[str]:
        for arg in value:
            _no_nul(arg, "an extra_args entry")
        return value


class RatioCheck(BaseModel):
    """Canary / baseline of a figure (medians over the analysis window) must be at least min_ratio;
    null: shown in the table, not judged."""
    model_config = ConfigDict(extra="forbid")
    min_ratio: float | None = Field(None, ge=0, le=10, allow_inf_nan=False)


class IncreaseCheck(BaseModel):
    """The canary's share of failed requests may exceed the baseline's by at most max_increase
    (0.01: one percentage point); null: shown, not judged."""
    model_config = ConfigDict(extra="forbid")
    max_increase: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)


class Analysis(BaseModel):
    """Canary analysis (`deploy/restart --rolling --canary N`): the canary vs the baseline (hosts
    still on what served before) over one window. See stages/canary.py."""
    model_config = ConfigDict(extra="forbid")
    window: float = Field(60.0, gt=0, le=86400, allow_inf_nan=False)  # seconds; --analysis-window overrides
    interval: float = Field(5.0, gt=0, le=3600, allow_inf_nan=False)  # seconds between two reads of /metrics
    # Intervals in which a server decoded (its token counter moved), per side, before a figure is judged.
    min_samples: int = Field(5, ge=1, le=100000)
    inconclusive: Literal["pause", "fail"] = "pause"  # too few samples: wait for a human, or revert
    accept_length: RatioCheck = RatioCheck(min_ratio=0.9)
    accept_rate: RatioCheck = RatioCheck()
    throughput: RatioCheck = RatioCheck(min_ratio=0.85)
    error_rate: IncreaseCheck = IncreaseCheck(max_increase=0.01)

    @model_validator(mode="after")
    def _interval_within_window(self) -> "Analysis":
        if self.interval > self.window:
            raise ValueError(f"interval ({self.interval:g} s) is longer than the window ({self.window:g} s): "
                             "no two reads of a server would fall in it")
        return self


class ProfileModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: str = ""
    model: Model | None = None
    speculative: Speculative | None = None
    # auto: add the hybrid companion flags when the host's model config is hybrid; on/off force it.
    hybrid: Literal["auto", "on", "off"] = "auto"

    @field_validator("hybrid", mode="before")
    @classmethod
    def _yaml_booleans(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `off`/`on` as a boolean; the user meant the word.
        return {False: "off", True: "on"}.get(value, value) if isinstance(value, bool) else value
    server: Server = Server()
    env: dict[str, str] = {}
    artifacts: ArtifactsRef = ArtifactsRef()
    analysis: Analysis = Analysis()

    @field_validator("name", mode="before")
    @classmethod
    def _name(cls, value: Any) -> Any:
        import re

        if isinstance(value, str) and not re.fullmatch(NAME_PATTERN, value):
            raise ValueError(f"profile name {value!r} must be a safe slug (letters, digits, '.', '_', '-'; "
                             "starting with a letter or digit; at most 63 characters): it names files, a "
                             "systemd unit and shell text on hosts")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        import re

        for key, item in value.items():
            if not re.fullmatch(ENV_KEY_PATTERN, key):
                raise ValueError(f"env key {key!r} is not a variable name ([A-Za-z_][A-Za-z0-9_]*): the env "
                                 "file is sourced by a shell and read by systemd")
            _no_nul(item, f"env {key}")
        return value

    # Top-level keys that were renamed: old -> new (the error for the old one names the new).
    RENAMED_KEYS: ClassVar[dict[str, str]] = {"deploy": "artifacts"}


@dataclass
class Artifacts:
    patchset: Patchset | None
    extension: Extension | None
    notes: list[str]


@dataclass
class Profile:
    path: Path
    model: ProfileModel
    source: SourceMap

    @property
    def name(self) -> str:
        return self.model.name

    def resolve(self, relative: str) -> Path:
        return (self.path.parent / relative).resolve()

    def artifacts(self) -> Artifacts:
        refs, notes = self.model.artifacts, []
        patchset = load_patchset(self.resolve(refs.patchset)) if refs.patchset else None
        extension = None
        if refs.extension:
            where = self.resolve(refs.extension.path)
            if (where / "metadata.json").is_file() or not refs.extension.optional:
                extension = load_extension(where)
            else:
                notes.append(f"extension {refs.extension.path} is not built (make kernels); "
                             "deploying without it")
        return Artifacts(patchset, extension, notes)


def _is_file(path: Path) -> bool:
    try:  # a name too long for the file system, or one with a NUL, is no file
        return path.is_file()
    except (OSError, ValueError):
        return False


def find_profile(name_or_path: str) -> Path:
    """A path to a .yaml file, or a name looked up in $SGLFLEET_PLAYBOOKS, ./playbooks, then
    the playbooks/ shipped next to this package."""
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml"):
        if not _is_file(candidate):
            raise ConfigError(f"profile file {name_or_path} does not exist")
        return candidate
    dirs = [Path(d) for d in os.environ.get("SGLFLEET_PLAYBOOKS", "").split(os.pathsep) if d]
    dirs += [Path("playbooks"), data_dir("playbooks")]
    for d in dirs:
        for suffix in (".yaml", ".yml"):
            if _is_file(d / f"{name_or_path}{suffix}"):
                return d / f"{name_or_path}{suffix}"
    known = sorted({p.stem for d in dirs if d.is_dir() for p in d.glob("*.y*ml")})
    raise ConfigError(f"no profile named {name_or_path!r} (looked in {', '.join(str(d) for d in dirs)}); "
                      f"known profiles: {', '.join(known) or 'none'}")


def load_profile(name_or_path: str) -> Profile:
    path = find_profile(name_or_path)
    model, data = load_model(path, ProfileModel, "a profile")
    return Profile(path, model, data)


def merge(base: Any, override: Any) -> Any:
    """Deep merge: mappings merge key by key, anything else (lists included) is replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            out[key] = merge(base.get(key), value) if key in base else value
        return out
    return override


def with_overrides(profile: Profile, overrides: dict[str, Any] | None, where: str) -> Profile:
    """The profile with the inventory's `sglfleet_profile_overrides` for it applied (see README: precedence)."""
    if not overrides:
        return profile
    if not isinstance(overrides, dict):
        raise ConfigError(f"sglfleet_profile_overrides for {profile.name} from {where} must be a mapping of profile keys "
                          f"(e.g. server: {{port: 30001}}), got a {type(overrides).__name__}")
    merged = merge(profile.model.model_dump(), overrides)
    try:
        model = ProfileModel.model_validate(merged)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"sglfleet_profile_overrides for {profile.name} from {where}: {loc}: {first['msg']}") from None
    return Profile(profile.path, model, profile.source)
