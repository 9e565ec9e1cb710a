"""No top-level name of this checkout shadows an installed distribution (issue: the repository's
`kernels` package shadowed Hugging Face's `kernels`, which transformers >= 5.25 imports, and the
tiny-model decode test failed on every fresh machine).

Three guards:
- the import itself, in a process with the suite's own sys.path and the checkout as its working
  directory: transformers' hub-kernels integration and Hugging Face's `kernels` import cleanly;
- every name that a directory of ours puts on sys.path (the checkout root under pytest and
  `python -m`, kernels/ for the `ddtree` package, bench/ for `python bench/X.py`, the host-side
  kernel build's own directory) against the top-level names of every distribution installed in
  the suite's environment and, where the lab image exists, in the lab hosts' environment, and
  against the standard library;
- the call convention's bootstrap keeps the working directory off sys.path, so a host's login
  directory (or the checkout, for `smoke --local`) cannot shadow what the remote scripts import.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.fleet import remote_call
from orchestrator.lab import base as lab_base
from orchestrator.stages import kernels as kernels_stage

ROOT = Path(__file__).resolve().parent.parent
# Directories a process of ours puts first on sys.path, and why.
PATH_ROOTS = {
    ".": "pytest's rootdir and `python -m ...` from the checkout",
    "kernels": "the ddtree package's root (pyproject's pytest pythonpath, make kernels, device_run.sh)",
    "bench": "`python bench/X.py` puts bench/ first",
}


def importable_names(directory: Path) -> set[str]:
    """Names `import NAME` would find as a regular module or package in `directory` (a folder
    without __init__.py is a namespace portion: any installed regular package wins over it)."""
    names = set()
    for entry in directory.iterdir():
        if entry.name.startswith((".", "_")):
            continue
        if entry.is_file() and entry.suffix == ".py":
            names.add(entry.stem)
        elif entry.is_dir() and (entry / "__init__.py").is_file():
            names.add(entry.name)
    return names


def names_of_distributions(python: str) -> dict[str, list[str]]:
    code = "import importlib.metadata as m, json; print(json.dumps(m.packages_distributions()))"
    out = subprocess.run([python, "-I", "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)


def lab_python() -> str | None:
    python = lab_base.base_dir() / "root" / "ml-env" / "bin" / "python3"
    return str(python) if python.exists() else None


def test_transformers_hub_kernels_imports_with_the_checkout_on_the_path():
    pytest.importorskip("transformers")
    code = ("import transformers.integrations.hub_kernels as hub, importlib.util, json\n"
            "spec = importlib.util.find_spec('kernels')\n"
            "origin = spec.origin if spec else None\n"
            "cuda = None\n"
            "if spec is not None:\n"
            "    from kernels import CUDAProperties\n"
            "    cuda = CUDAProperties.__module__\n"
            "print(json.dumps({'origin': origin, 'cuda': cuda}))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    if found["origin"] is not None:  # Hugging Face's kernels is installed: it must be the one found
        assert "site-packages" in Path(found["origin"]).parts, found
        assert not Path(found["origin"]).resolve().is_relative_to(ROOT / "kernels"), found
        assert found["cuda"] and found["cuda"].startswith("kernels"), found


def test_the_ddtree_package_imports_under_its_own_name():
    import ddtree

    assert Path(ddtree.__file__).resolve().parent == ROOT / "kernels" / "ddtree"
    assert not (ROOT / "kernels" / "__init__.py").exists(), "kernels/ must not be an importable package"


@pytest.mark.parametrize("where", sorted(PATH_ROOTS))
def test_no_top_level_name_of_ours_shadows_an_installed_distribution(where):
    ours = importable_names(ROOT / where)
    assert ours, f"{where}: expected importable names"
    environments = {"suite": names_of_distributions(sys.executable)}
    if lab_python():
        environments["lab hosts"] = names_of_distributions(lab_python())
    clashes = []
    for env_name, installed in environments.items():
        others = {name for name, dists in installed.items() if set(dists) - {"sglfleet"}}  # sglfleet: this checkout, installed editable
        clashes += [f"{where}/{name} shadows {installed[name]} ({env_name})" for name in sorted(ours & others)]
    clashes += [f"{where}/{name} shadows the standard library" for name in sorted(ours & set(sys.stdlib_module_names))]
    assert not clashes, "\n".join(clashes)


def test_the_host_side_kernel_build_directory_holds_only_ddtree():
    tops = {path.split("/", 1)[0] for path, _ in kernels_stage.sources()}
    assert tops == {"ddtree"}
    for python in filter(None, (sys.executable, lab_python())):
        assert "ddtree" not in names_of_distributions(python), python


def _boot(cwd: Path, script: bytes) -> dict:
    """Run `script`'s command `probe` through the call convention's real bootstrap, from `cwd`."""
    hostlib = remote_call.script_bytes(remote_call.HOSTLIB)
    args = b"{}"
    stdin = f"{len(hostlib)} {len(script)} {len(args)}".encode() + b"\n" + hostlib + script + args
    command = remote_call.command_line(sys.executable, "probe.py", "probe")
    proc = subprocess.run(["/bin/sh", "-c", command], input=stdin, cwd=cwd, capture_output=True, timeout=60)
    return json.loads(proc.stdout)


def test_the_bootstrap_keeps_the_working_directory_off_sys_path(tmp_path):
    # A working directory whose `kernels` package would break the import, as the checkout's did.
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("raise ImportError('the working directory shadowed kernels')\n")
    (tmp_path / "json_shadow_marker.py").write_text("")
    script = (b"import sys, importlib.util\n"
              b"def probe(args, stream):\n"
              b"    spec = importlib.util.find_spec('kernels')\n"
              b"    return {'path': sys.path, 'kernels': spec.origin if spec else None,\n"
              b"            'marker': importlib.util.find_spec('json_shadow_marker') is not None}\n"
              b"COMMANDS = {'probe': probe}\n")
    answer = _boot(tmp_path, script)
    assert answer["ok"], answer
    value = answer["value"]
    assert "" not in value["path"] and str(tmp_path) not in value["path"]
    assert value["marker"] is False
    assert value["kernels"] is None or not value["kernels"].startswith(str(tmp_path))
