"""Inputs that must never run as code or reach outside where they belong (issue: hardening).

Patchsets ship only the files they hold or declare, import checks import modules by name, and
`patchset init` writes only inside --out. No SSH needed: each refusal happens before a connection.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from orchestrator.errors import ConfigError
from orchestrator.remote import hostlib, release
from orchestrator.spec.patchset import load_patchset

from .conftest import sglfleet

MANIFEST = "name: t\npackage: sglang\nversions: '>=0'\n"


def patchset(tmp_path: Path, body: str) -> Path:
    directory = tmp_path / "ps"
    (directory / "files").mkdir(parents=True, exist_ok=True)
    (directory / "files" / "mine.py").write_text("X = 1\n")
    (directory / "patchset.yaml").write_text(MANIFEST + body)
    return directory


@pytest.mark.parametrize("name", ["os; os.system('touch /tmp/pwned')", "__import__('os')", "a..b", "sglang.",
                                  "1abc", "a b", "x\nimport os"])
def test_import_check_names_must_be_dotted_module_names(tmp_path, name):
    directory = patchset(tmp_path, "import_check:\n  - " + json.dumps(name) + "\n")
    with pytest.raises(ConfigError) as info:
        load_patchset(directory)
    assert f"{directory}/patchset.yaml:4: import_check.0:" in str(info.value)
    assert "is not a dotted module name" in str(info.value)


def test_the_host_imports_check_modules_by_name_never_as_source(tmp_path):
    host = release.Host.__new__(release.Host)
    marker = tmp_path / "ran"
    release.check_python(host, [], ["json", "os.path"])  # plain names import fine
    with pytest.raises(hostlib.Failure, match="not module names"):
        release.check_python(host, [], [f"os; open({str(marker)!r}, 'w')"])
    assert not marker.exists()
    with pytest.raises(hostlib.Failure, match="import check failed"):
        release.check_python(host, [], ["no_such_module_here"])


def test_a_source_that_is_a_symlink_is_refused_at_load(tmp_path):
    directory = patchset(tmp_path, "files:\n  - path: srt/x.py\n    source: files/link.py\n    replaces: new\n")
    (directory / "files" / "link.py").symlink_to("/etc/hostname")
    with pytest.raises(ConfigError) as info:
        load_patchset(directory)
    assert f"{directory}/patchset.yaml:6: files.0.source: files/link.py is (or passes through) a symlink" \
        in str(info.value)


def test_a_source_outside_the_patchset_is_refused_unless_its_directory_is_declared(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "ops.py").write_text("Y = 2\n")
    body = "files:\n  - path: srt/ops.py\n    source: ../shared/ops.py\n    replaces: new\n"
    directory = patchset(tmp_path, body)
    with pytest.raises(ConfigError) as info:
        load_patchset(directory)
    assert "patchset.yaml:6: files.0.source: ../shared/ops.py resolves to" in str(info.value)
    assert "outside the patchset directory" in str(info.value)
    (directory / "patchset.yaml").write_text(MANIFEST + "source_dirs: [../shared]\n" + body)
    assert load_patchset(directory).sources == {"srt/ops.py": b"Y = 2\n"}


def test_a_symlinked_directory_on_the_way_to_a_source_is_refused(tmp_path):
    real = tmp_path / "elsewhere"
    real.mkdir()
    (real / "f.py").write_text("Z = 3\n")
    directory = patchset(tmp_path, "files:\n  - path: srt/f.py\n    source: files/sub/f.py\n    replaces: new\n")
    (directory / "files" / "sub").symlink_to(real)
    with pytest.raises(ConfigError, match="passes through"):
        load_patchset(directory)


@pytest.mark.parametrize("new_under", ["../../..", "/etc", "srt/../../x"])
def test_patchset_init_refuses_a_new_under_that_leaves_the_package(tmp_path, new_under):
    edited = tmp_path / "edits"
    edited.mkdir()
    (edited / "new_module.py").write_text("A = 1\n")
    inventory = tmp_path / "inv.yaml"
    inventory.write_text("all:\n  hosts:\n    h1: {ansible_host: 127.0.0.5}\n")
    out = tmp_path / "out"
    proc = sglfleet("patchset", "init", "--from", str(edited), "--against", "h1", "--out", str(out),
                    "--new-under", new_under, "-i", str(inventory))
    assert proc.returncode == 2, proc.stderr
    assert f"--new-under {new_under}:" in proc.stderr and "relative path inside the package" in proc.stderr
    assert not out.exists()


def test_patchset_init_refuses_symlinks_among_the_edited_files(tmp_path):
    edited = tmp_path / "edits"
    edited.mkdir()
    os.symlink("/etc/hostname", edited / "server_args.py")
    from orchestrator.stages.release import init_patchset

    with pytest.raises(ConfigError, match="holds symlinks"):
        init_patchset(None, edited, "sglang", None)  # refused before any connection is used
