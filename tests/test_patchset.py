"""Patchset manifests and rendering against pristine files (the push issue builds on this)."""

from __future__ import annotations

import textwrap

import pytest

from orchestrator.errors import ConfigError
from orchestrator.spec.patchset import PatchError, load_patchset, sha256

from .conftest import ROOT

PRISTINE_ARGS = b"import os\n\n\ndef prepare_server_args(argv):\n    return parse(argv)\n"
PRISTINE_INFO = b"class SpecInfo:\n    pass\n"


def make(tmp_path, manifest: str, files: dict[str, bytes] | None = None):
    (tmp_path / "patchset.yaml").write_text(textwrap.dedent(manifest))
    for name, data in (files or {}).items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    return tmp_path


GOOD = f"""\
name: demo
package: sglang
versions: "==0.5.23"
files:
  - path: srt/speculative/ddtree_utils.py
    source: files/ddtree_utils.py
    replaces: new
  - path: srt/speculative/spec_info.py
    source: files/spec_info.py
    replaces: {sha256(PRISTINE_INFO)}
edits:
  - path: srt/server_args.py
    pristine_sha256: {sha256(PRISTINE_ARGS)}
    anchor: "def prepare_server_args("
    where: before
    insert: "# sglfleet: DDTree flags\\nDDTREE = True\\n"
"""
FILES = {"files/ddtree_utils.py": b"def build():\n    pass\n", "files/spec_info.py": b"class SpecInfo:\n    DDTREE = 1\n"}


def test_render_places_files_and_applies_anchored_edits(tmp_path):
    patchset = load_patchset(make(tmp_path, GOOD, FILES))
    assert patchset.targets() == ["srt/server_args.py", "srt/speculative/ddtree_utils.py",
                                  "srt/speculative/spec_info.py"]
    out = patchset.render({"srt/server_args.py": PRISTINE_ARGS, "srt/speculative/spec_info.py": PRISTINE_INFO,
                           "srt/speculative/ddtree_utils.py": None})
    assert out["srt/speculative/ddtree_utils.py"] == FILES["files/ddtree_utils.py"]
    assert out["srt/speculative/spec_info.py"] == FILES["files/spec_info.py"]
    assert out["srt/server_args.py"] == (b"import os\n\n\n# sglfleet: DDTree flags\nDDTREE = True\n"
                                         b"def prepare_server_args(argv):\n    return parse(argv)\n")
    assert patchset.supports("0.5.23") and not patchset.supports("0.5.22") and not patchset.supports("dev")


@pytest.mark.parametrize("pristine,message", [
    ({"srt/server_args.py": PRISTINE_ARGS, "srt/speculative/spec_info.py": b"drifted\n",
      "srt/speculative/ddtree_utils.py": None}, "spec_info.py: not the pristine file"),
    ({"srt/server_args.py": PRISTINE_ARGS, "srt/speculative/spec_info.py": PRISTINE_INFO,
      "srt/speculative/ddtree_utils.py": b"already here\n"}, "adds it as new, but the package already has"),
    ({"srt/server_args.py": PRISTINE_ARGS + b"# edited by hand\n", "srt/speculative/spec_info.py": PRISTINE_INFO,
      "srt/speculative/ddtree_utils.py": None}, "server_args.py: not the pristine file the edit expects"),
    ({"srt/speculative/spec_info.py": PRISTINE_INFO, "srt/speculative/ddtree_utils.py": None},
     "server_args.py: missing from the package"),
])
def test_render_refuses_what_it_cannot_apply_exactly(tmp_path, pristine, message):
    with pytest.raises(PatchError, match=message):
        load_patchset(make(tmp_path, GOOD, FILES)).render(pristine)


def test_anchor_must_match_exactly_once(tmp_path):
    manifest = """\
        name: demo
        package: sglang
        versions: ">=0.5"
        edits:
          - path: a.py
            anchor: "return"
            insert: "x = 1"
    """
    patchset = load_patchset(make(tmp_path, manifest))
    with pytest.raises(PatchError, match="matches 2 times"):
        patchset.render({"a.py": b"return 1\nreturn 2\n"})
    with pytest.raises(PatchError, match="matches 0 times"):
        patchset.render({"a.py": b"pass\n"})
    assert patchset.render({"a.py": b"def f():\n    return 1\n"})["a.py"] == b"def f():\n    return 1\nx = 1\n"


@pytest.mark.parametrize("manifest,line,message", [
    ("name: x\npackage: sglang\nversions: '==0.5.23'\nfilez: []\n", 4, "unknown key 'filez'"),
    ("name: x\npackage: sglang\nversions: 'soon'\n", 3, "not a version specifier"),
    ("name: x\npackage: sglang\nversions: '==1'\nfiles:\n  - path: ../etc/passwd\n    source: a\n    replaces: new\n",
     5, "must be a relative path inside the package"),
    ("name: x\npackage: sglang\nversions: '==1'\nfiles:\n  - path: a.py\n    source: a\n    replaces: abc\n",
     7, "must be 'new' or a 64-character lowercase sha256"),
    ("name: x\npackage: sglang\nversions: '==1'\nfiles:\n  - path: a.py\n    source: nope.py\n    replaces: new\n",
     6, "nope.py does not exist"),
    ("name: x\nversions: '==1'\n", 1, "package: Field required"),
    ("name: x\npackage: sglang\nversions: '==1'\nprovides: [flags, wroker]\n", 4, "'flags', 'validation', 'tree_ops' or 'worker'"),
    ("name: x\npackage: sglang\nversions: '==1'\nrequires: {torch: 'two'}\n", 4, "'two' is not a version specifier"),
])
def test_bad_manifests_report_file_and_line(tmp_path, manifest, line, message):
    make(tmp_path, manifest)
    with pytest.raises(ConfigError) as info:
        load_patchset(tmp_path)
    assert str(info.value).startswith(f"{tmp_path / 'patchset.yaml'}:{line}: "), str(info.value)
    assert message in str(info.value)


def test_what_a_patchset_provides_and_pins(tmp_path):
    """`provides:` says whether a patchset's server can decode DDTREE (SGLang lacks it; DFLASH it
    has); `requires:` pins the host's python and torch beside `versions` (sglfleet doctor)."""
    bundled = load_patchset(ROOT / "patches" / "sglang-0.5.23-ddtree")
    assert bundled.manifest.provides == ["flags", "validation", "tree_ops"]
    assert bundled.serves("DDTREE") is False and bundled.serves("DFLASH") is True
    assert bundled.pin_mismatches({"sglang": "0.5.23", "python": "3.11.2", "torch": "2.14.1+cu130"}) == []
    assert bundled.pin_mismatches({"sglang": "0.5.22", "python": "3.10.1", "torch": None}) == [
        "sglang 0.5.22 (the patchset pins ==0.5.23)", "python 3.10.1 (the patchset pins >=3.11)",
        "torch is not installed (the patchset pins ==2.14.1)"]
    unstated = load_patchset(make(tmp_path, "name: x\npackage: sglang\nversions: '==0.5.23'\n"))
    assert unstated.serves("DDTREE") is None and unstated.manifest.requires == {}
    (tmp_path / "w").mkdir()
    worker = load_patchset(make(tmp_path / "w", "name: w\npackage: sglang\nversions: '==0.5.23'\n"
                                "provides: [flags, validation, tree_ops, worker]\n"))
    assert worker.serves("DDTREE") is True
