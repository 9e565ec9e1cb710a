"""The option-list caches: the host's (remote/server_facts.py) and the controller's
(stages/sglang_options.py), without SGLang: a fake install's files give the fingerprint."""

from __future__ import annotations

import argparse
import json
import os
import time

import pytest

from orchestrator.remote import server_facts
from orchestrator.stages import sglang_options
from orchestrator.stages.render import RenderError, _check_known

LISTED = {"options": ["--model-path", "--port", "--speculative-algorithm"], "undocumented": ["--old-name"]}


@pytest.fixture
def controller_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(sglang_options, "_known", None)
    return tmp_path / "xdg" / "sglfleet" / "sglang-options"


@pytest.fixture
def install(tmp_path):
    """A fake sglang package dir: only the files the fingerprint reads."""
    root = tmp_path / "sglang"
    (root / "srt").mkdir(parents=True)
    (root / "srt" / "server_args.py").write_text("# the arguments\n")
    return root


def no_listing(*args, **kwargs):
    raise AssertionError("SGLang was imported to list its options")


def test_host_cache_then_controller_fingerprint_then_listing(install, tmp_path, monkeypatch):
    state = tmp_path / "state"
    monkeypatch.setattr(server_facts.subprocess, "run", no_listing)
    fingerprint = server_facts.args_fingerprint(str(install), "0.5.23")
    # the controller knows it: answered by name, nothing imported, nothing written
    assert server_facts.option_strings(str(install), "0.5.23", str(state), [fingerprint]) == \
        (None, "controller", None, fingerprint)
    assert not state.exists()
    # the host's own cache wins over the controller's
    server_facts._keep(server_facts._cache_path(str(state), fingerprint), LISTED)
    assert server_facts.option_strings(str(install), "0.5.23", str(state), [fingerprint]) == \
        (LISTED, "host", None, fingerprint)
    # patched files: another fingerprint, known to neither, so it is listed (here: the listing fails)
    (install / "srt" / "server_args.py").write_text("# the arguments, patched\n")

    class Failed:
        returncode, stdout, stderr = 1, b"", b"ModuleNotFoundError: No module named 'sglang'"

    monkeypatch.setattr(server_facts.subprocess, "run", lambda *a, **k: Failed())
    listed, source, error, other = server_facts.option_strings(str(install), "0.5.23", str(state), [fingerprint])
    assert (listed, source, other != fingerprint) == (None, None, True) and "No module named" in error


def test_remember_options_lists_with_the_imported_class_and_keeps_a_missing_list(install, tmp_path, monkeypatch):
    monkeypatch.setattr(server_facts.hostlib, "locate_package",
                        lambda name: {"root": str(install), "version": "0.5.23"})

    class ServerArgs:
        @staticmethod
        def add_cli_args(parser):
            parser.add_argument("--port")
            parser.add_argument("--old-port", help=argparse.SUPPRESS)

    remembered = server_facts.remember_options(ServerArgs, str(tmp_path / "state"))
    fingerprint = server_facts.args_fingerprint(str(install), "0.5.23")
    listed = {"options": ["--help", "--old-port", "--port", "-h"], "undocumented": ["--old-port"]}  # as argparse has them
    assert remembered == {"fingerprint": fingerprint, **listed}
    path = server_facts._cache_path(str(tmp_path / "state"), fingerprint)
    assert json.loads(open(path).read()) == listed


def test_controller_cache_stores_fills_in_and_tells_the_fingerprints(controller_cache):
    fingerprint = "0123456789abcdef01234567"
    listed_by_host = {"sglang": {"installed": True, "options_fingerprint": fingerprint, "options_cached": None,
                                 **LISTED}}
    sglang_options.complete(listed_by_host)
    assert sglang_options.known() == [fingerprint]
    assert json.loads((controller_cache / f"{fingerprint}.json").read_text()) == LISTED
    by_name = {"sglang": {"installed": True, "options_fingerprint": fingerprint, "options_cached": "controller",
                          "options": None, "undocumented": None}}
    assert sglang_options.complete(by_name)["sglang"]["options"] == LISTED["options"]
    assert by_name["sglang"]["undocumented"] == LISTED["undocumented"]
    assert list(controller_cache.glob(".*tmp")) == []


def test_a_list_lost_between_call_and_answer_is_a_clear_render_error(controller_cache):
    fingerprint = "fedcba9876543210fedcba98"
    facts = {"sglang": {"installed": True, "version": "0.5.23", "options_fingerprint": fingerprint,
                        "options_cached": "controller", "options": None}}
    sglang_options.complete(facts)
    with pytest.raises(RenderError, match=f"lost the list for fingerprint {fingerprint}.*run the command again"):
        _check_known("ct129", [], facts["sglang"])


@pytest.mark.parametrize("fingerprint, listed", [
    ("../../etc/passwd00000000", LISTED), ("0123", LISTED), (None, LISTED),
    ("0123456789abcdef01234567", {"options": "--port", "undocumented": []}),
    ("0123456789abcdef01234567", {"options": [1, 2], "undocumented": []}),
])
def test_what_a_host_sends_is_kept_only_when_it_is_a_fingerprint_and_a_list(controller_cache, fingerprint, listed):
    sglang_options.store(fingerprint, listed)
    assert not controller_cache.exists() or list(controller_cache.iterdir()) == []


def test_the_newest_lists_are_kept(controller_cache, monkeypatch):
    monkeypatch.setattr(sglang_options, "KEEP", 3)
    for n in range(5):
        sglang_options.store(f"{n:024x}", LISTED)
        os.utime(controller_cache / f"{n:024x}.json", (time.time() - 100 + n, time.time() - 100 + n))
    assert sglang_options.known() == [f"{n:024x}" for n in (2, 3, 4)]
