"""Plan classification from an inspection document (no host): current/add/change/update/drifted."""

from __future__ import annotations

import textwrap

from orchestrator.spec.artifacts import Extension
from orchestrator.spec.patchset import load_patchset, sha256
from orchestrator.spec.profile import Artifacts
from orchestrator.stages.release import make_plan

PRISTINE = b"def f():\n    return 1\n"
OURS_OLD = b"def f():\n    return 0\n"


def artifacts(tmp_path, extension=None):
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "new.py").write_bytes(b"NEW = 1\n")
    (tmp_path / "files" / "f.py").write_bytes(b"def f():\n    return 2\n")
    (tmp_path / "patchset.yaml").write_text(textwrap.dedent(f"""\
        name: t
        package: sglang
        versions: "==0.5.23"
        files:
          - {{path: srt/new.py, source: files/new.py, replaces: new}}
          - {{path: srt/f.py, source: files/f.py, replaces: {sha256(PRISTINE)}}}
    """))
    return Artifacts(load_patchset(tmp_path), extension, [])


def inspected(files, version="0.5.23", torch=("2.14.1+cu130", "13.0"), archs=("sm_90",)):
    return {"package": {"name": "sglang", "version": version}, "python": {"tag": "cp311"},
            "torch": {"version": torch[0], "cuda": torch[1]}, "gpus": [{"arch": a} for a in archs],
            "files": files, "interrupted": None}


def state(data, ours=None):
    if data is None:
        return {"exists": False, "sha256": None}
    return {"exists": True, "sha256": sha256(data), "ours": ours}


def statuses(plan):
    return {f.key: f.status for f in plan.files}


def test_fresh_host_adds_and_changes(tmp_path):
    plan = make_plan("h", inspected({"pkg/srt/new.py": state(None), "pkg/srt/f.py": state(PRISTINE)}),
                     artifacts(tmp_path))
    assert statuses(plan) == {"pkg/srt/new.py": "add", "pkg/srt/f.py": "change"} and not plan.refusals


def test_current_update_and_drift(tmp_path):
    arts = artifacts(tmp_path)
    files = {"pkg/srt/new.py": state(b"NEW = 1\n", ours="r1"), "pkg/srt/f.py": {**state(OURS_OLD, ours="r1"),
                                                                                "base_sha256": sha256(PRISTINE)}}
    assert statuses(make_plan("h", inspected(files), arts)) == {"pkg/srt/new.py": "current", "pkg/srt/f.py": "update"}
    files["pkg/srt/f.py"] = state(b"hand edited\n")
    plan = make_plan("h", inspected(files), arts)
    assert statuses(plan)["pkg/srt/f.py"] == "drifted" and "drifted" in plan.refusals[0]
    forced = make_plan("h", inspected(files), arts, force=True)
    assert statuses(forced)["pkg/srt/f.py"] == "forced" and not forced.refusals
    files["pkg/srt/new.py"] = state(b"someone else's file\n")
    assert statuses(make_plan("h", inspected(files), arts))["pkg/srt/new.py"] == "drifted"


def test_unsupported_version_and_fingerprint_mismatch(tmp_path):
    ext = Extension(tmp_path, "ddtree-ext", "ddtree_ext.so", b"\x7fELF",
                    {"python_tag": "cp311", "torch_version": "2.14.1", "cuda_version": "13.0", "arch_list": ["sm_90"]})
    files = {"pkg/srt/new.py": state(None), "pkg/srt/f.py": state(PRISTINE), "purelib/ddtree_ext.so": state(None)}
    plan = make_plan("h", inspected(files, version="0.5.22"), artifacts(tmp_path, ext))
    assert "sglang 0.5.22 is not supported by patchset t (==0.5.23)" in plan.refusals[0]
    assert statuses(plan) == {"purelib/ddtree_ext.so": "add"}  # the extension still matches this host
    other = tmp_path / "other"
    other.mkdir()
    plan = make_plan("h", inspected(files, archs=("sm_80",), torch=("2.14.1+cu128", "12.8")), artifacts(other, ext))
    assert "purelib/ddtree_ext.so" not in statuses(plan)
    assert "torch CUDA 12.8 (built for 13.0)" in plan.notes[0] and "GPU arch sm_80 (built for sm_90)" in plan.notes[0]
