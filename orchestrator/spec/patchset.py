"""Patchsets: what sglfleet changes in an installed package, described so it can be verified.

A patchset is a directory with `patchset.yaml`:

    name: sglang-0.5.23-ddtree
    package: sglang
    versions: "==0.5.23"              # a PEP 440 specifier the installed version must satisfy
    files:                            # whole files placed at a path relative to the package root
      - path: srt/speculative/ddtree_utils.py
        source: files/ddtree_utils.py # relative to the patchset directory
        replaces: new                 # or the sha256 of the pristine file it replaces
    source_dirs: [../../kernels/ddtree] # optional: directories outside this one that sources
                                      # may come from (declared, so nothing else can be shipped)
    import_check: [sglang.srt.speculative.ddtree_plugin]  # dotted module names, imported on the host
    requires: {python: ">=3.10", torch: "==2.14.1"}  # optional: PEP 440 pins of the host's python
                                      # and of distributions beside the package (sglfleet doctor)
    provides: [flags, validation, tree_ops]  # optional: what it makes the package able to do;
                                      # without `worker` it cannot serve DDTREE (see `serves`)
    edits:                            # anchored edits of files we may not copy
      - path: srt/server_args.py
        pristine_sha256: 3f2a...      # optional: refuse to edit anything else
        anchor: "def prepare_server_args("
        where: before                 # before | after the anchor
        insert: |
          # sglfleet: DDTree flags
          ...

A source must be a regular file (not a symlink) inside the patchset directory or one of its
declared `source_dirs`. An anchor must match exactly once in the pristine file. `render()` turns the pristine files of
one host into the exact bytes each target path must hold, or says precisely why it cannot.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Annotated, Literal, get_args

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version
from pydantic import AfterValidator, BaseModel, ConfigDict, field_validator

from ..errors import ConfigError, SglfleetError
from .yamlsrc import load_model

NEW = "new"

# What a patchset can make SGLang able to do (its `provides:`): new launch flags, their
# validation in SGLang's resolve phase, the draft-tree utilities, and the speculative worker that
# actually decodes. An algorithm SGLang lacks is served only by a patchset that provides `worker`.
Capability = Literal["flags", "validation", "tree_ops", "worker"]
CAPABILITIES = get_args(Capability)
# Speculative algorithms the SGLang releases we patch do not have (0.5.23 has DFLASH, not DDTREE):
# a server for one of them runs a patchset's worker or fails at start.
ALGORITHMS_NEEDING_A_WORKER = ("DDTREE",)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def package_relative(path: str) -> str:
    """A path relative to the package root, with no way out of it."""
    p = PurePosixPath(path)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise ValueError("must be a relative path inside the package, without '..'")
    return str(p)


# A dotted Python module name: what import_check may name (it is imported, never run as source).
MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")


def module_name(value: str) -> str:
    if not isinstance(value, str) or not MODULE_NAME.match(value):
        raise ValueError(f"{value!r} is not a dotted module name such as 'sglang.srt.speculative'")
    return value


def specifier(value: str) -> str:
    try:
        SpecifierSet(value)
    except InvalidSpecifier:
        raise ValueError(f"'{value}' is not a version specifier such as '==0.5.23'") from None
    return value


def _hash_or_new(value: str | None) -> str | None:
    if value is None or value == NEW:
        return value
    if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise ValueError("must be 'new' or a 64-character lowercase sha256")
    return value


class _Entry(BaseModel):
    """A change to one path of the package."""

    model_config = ConfigDict(extra="forbid")
    path: str

    @field_validator("path")
    @classmethod
    def _check_path(cls, value: str) -> str:
        return package_relative(value)


class FileEntry(_Entry):
    source: str
    replaces: str

    @field_validator("replaces")
    @classmethod
    def _check_replaces(cls, value: str) -> str | None:
        return _hash_or_new(value)


class EditEntry(_Entry):
    anchor: str
    insert: str
    where: Literal["before", "after"] = "after"
    # Spaces put before every inserted line: YAML block scalars strip the common indentation,
    # and code inserted into a class body needs it back.
    indent: int = 0
    pristine_sha256: str | None = None

    @field_validator("pristine_sha256")
    @classmethod
    def _check_hash(cls, value: str | None) -> str | None:
        if value == NEW:
            raise ValueError("an edited file cannot be new; give its pristine sha256 or leave it out")
        return _hash_or_new(value)


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    package: str
    versions: str
    files: list[FileEntry] = []
    edits: list[EditEntry] = []
    # Modules a fresh interpreter on the host must import after the swap (default: the package).
    import_check: list[Annotated[str, AfterValidator(module_name)]] = []
    # Directories besides the patchset's own that sources may come from, relative to it.
    source_dirs: list[str] = []
    # PEP 440 pins of what the package runs with on the host: "python" (the interpreter) or a
    # distribution name (torch); `sglfleet doctor` checks them with `versions`.
    requires: dict[str, str] = {}
    # What the patchset makes the package able to do (CAPABILITIES); None: it does not say.
    provides: list[Capability] | None = None

    @field_validator("versions")
    @classmethod
    def _specifier(cls, value: str) -> str:
        return specifier(value)

    @field_validator("requires")
    @classmethod
    def _pins(cls, value: dict[str, str]) -> dict[str, str]:
        for name, spec in value.items():
            specifier(spec)
            if not re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z", name):
                raise ValueError(f"{name!r} is not 'python' or a distribution name such as 'torch'")
        return value


class PatchError(SglfleetError):
    """The patchset cannot be applied to what the host has."""


@dataclass
class Patchset:
    directory: Path
    manifest: Manifest
    sources: dict[str, bytes]  # target path -> our file's bytes

    @property
    def name(self) -> str:
        return self.manifest.name

    def targets(self) -> list[str]:
        """Every path in the package this patchset writes, each once, in a stable order."""
        return sorted({f.path for f in self.manifest.files} | {e.path for e in self.manifest.edits})

    def supports(self, version: str) -> bool:
        try:
            return Version(version) in SpecifierSet(self.manifest.versions)
        except InvalidVersion:
            return False

    def serves(self, algorithm: str) -> bool | None:
        """Whether a server built from this patchset can decode with `algorithm`: True, False (an
        algorithm SGLang lacks, and no `worker` in `provides`), None (`provides` is not stated)."""
        if algorithm not in ALGORITHMS_NEEDING_A_WORKER:
            return True
        provides = self.manifest.provides
        return None if provides is None else "worker" in provides

    def pin_mismatches(self, versions: dict[str, str | None]) -> list[str]:
        """What on the host breaks this patchset's pins: `versions` maps the package, "python" and
        each `requires` name to the host's version (None: not installed)."""
        pins = {self.manifest.package: self.manifest.versions, **self.manifest.requires}
        why = []
        for name, spec in pins.items():
            have = versions.get(name)
            if have is None:
                why.append(f"{name} is not installed (the patchset pins {spec})")
                continue
            try:
                ok = Version(have) in SpecifierSet(spec)
            except InvalidVersion:
                ok = False
            if not ok:
                why.append(f"{name} {have} (the patchset pins {spec})")
        return why

    def expected_pristine(self, path: str) -> str | None:
        """What the patchset says must be at `path` before it: a sha256, NEW, or None (unstated)."""
        for f in self.manifest.files:
            if f.path == path:
                return f.replaces
        return next((e.pristine_sha256 for e in self.manifest.edits if e.path == path), None)

    def edited(self, path: str) -> bool:
        """Whether `path` is only edited (its new bytes depend on the host's pristine file)."""
        return path not in self.sources and any(e.path == path for e in self.manifest.edits)

    def render(self, pristine: dict[str, bytes | None], verify: bool = True) -> dict[str, bytes]:
        """Pristine bytes per target path (None: absent) -> the bytes each path must hold.

        verify=False skips the pristine-hash checks (the caller classified the files itself,
        e.g. under --force); anchors must still match exactly once."""
        out: dict[str, bytes] = {}
        for entry in self.manifest.files:
            current = pristine.get(entry.path)
            if not verify:
                pass
            elif entry.replaces == NEW:
                if current is not None:
                    raise PatchError(f"{entry.path}: the patchset adds it as new, but the package already "
                                     f"has a file there (sha256 {sha256(current)[:12]}…)")
            elif current is None:
                raise PatchError(f"{entry.path}: missing from the package; the patchset replaces a file there")
            elif sha256(current) != entry.replaces:
                raise PatchError(f"{entry.path}: not the pristine file the patchset expects (sha256 "
                                 f"{sha256(current)[:12]}…, expected {entry.replaces[:12]}…)")
            out[entry.path] = self.sources[entry.path]
        for entry in self.manifest.edits:
            base = out.get(entry.path, pristine.get(entry.path))
            if base is None:
                raise PatchError(f"{entry.path}: missing from the package; an anchored edit needs it")
            if (verify and entry.pristine_sha256 and entry.path not in out
                    and sha256(base) != entry.pristine_sha256):
                raise PatchError(f"{entry.path}: not the pristine file the edit expects (sha256 "
                                 f"{sha256(base)[:12]}…, expected {entry.pristine_sha256[:12]}…)")
            text = base.decode("utf-8")
            count = text.count(entry.anchor)
            if count != 1:
                raise PatchError(f"{entry.path}: the anchor {entry.anchor!r} matches {count} times; "
                                 f"it must match exactly once")
            insert = entry.insert if entry.insert.endswith("\n") else entry.insert + "\n"
            if entry.indent:
                pad = " " * entry.indent
                insert = "".join(pad + line if line.strip() else line for line in insert.splitlines(True))
            at = text.index(entry.anchor)
            if entry.where == "after":
                line_end = text.find("\n", at + len(entry.anchor))
                at = len(text) if line_end < 0 else line_end + 1
            else:
                at = text.rfind("\n", 0, at) + 1
            out[entry.path] = (text[:at] + insert + text[at:]).encode("utf-8")
        return out


def load_patchset(directory: str | Path) -> Patchset:
    directory = Path(directory)
    manifest_path = directory / "patchset.yaml"
    shown = str(manifest_path)
    manifest, data = load_model(manifest_path, Manifest, "a patchset manifest (name, package, versions, files, edits)")
    sources: dict[str, bytes] = {}
    allowed = [directory.resolve()]
    for index, extra in enumerate(manifest.source_dirs):
        where = (directory / extra).resolve()
        if not where.is_dir():
            raise ConfigError(f"source_dirs.{index}: {extra} is not a directory", shown, data.line_of("source_dirs"))
        allowed.append(where)
    for index, entry in enumerate(manifest.files):
        source = directory / entry.source
        line = data["files"][index].line_of("source")
        if not source.is_file():
            raise ConfigError(f"files.{index}.source: {entry.source} does not exist in {directory}", shown, line)
        if _has_symlink(directory, source):
            raise ConfigError(f"files.{index}.source: {entry.source} is (or passes through) a symlink; a patchset "
                              "ships only regular files it holds", shown, line)
        real = source.resolve()
        if not any(real == root or root in real.parents for root in allowed):
            raise ConfigError(f"files.{index}.source: {entry.source} resolves to {real}, outside the patchset "
                              f"directory {directory}" + (" and its source_dirs" if manifest.source_dirs else "")
                              + "; declare the directory in source_dirs if it is meant to be shipped", shown, line)
        if entry.path in sources:
            raise ConfigError(f"files.{index}.path: {entry.path} is placed twice", shown,
                              data["files"][index].line_of("path"))
        sources[entry.path] = source.read_bytes()
    return Patchset(directory, manifest, sources)


def _has_symlink(directory: Path, source: Path) -> bool:
    """Whether `source` or any directory between `directory` and it is a symlink ('..' steps are
    normalised first, so a declared source dir outside the patchset is checked the same way)."""
    path = Path(os.path.normpath(directory / source.relative_to(directory)))
    base = Path(os.path.normpath(directory))
    while path != base and path != path.parent:
        if path.is_symlink():
            return True
        path = path.parent
    return False
