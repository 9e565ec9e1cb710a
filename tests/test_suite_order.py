"""The order a pytest-xdist run hands modules to its workers: longest first (tests/conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from .conftest import DURATIONS, longest_first


def item(module: str, test: str) -> SimpleNamespace:
    return SimpleNamespace(path=Path("tests") / module, name=test)


def test_longest_module_first_each_modules_order_kept():
    items = [item("test_a.py", "a1"), item("test_a.py", "a2"), item("test_b.py", "b1"), item("test_c.py", "c1"),
             item("test_c.py", "c2")]
    ordered = longest_first(items, {"test_a.py": 3.0, "test_b.py": 40.0, "test_c.py": 12.5})
    assert [i.name for i in ordered] == ["b1", "c1", "c2", "a1", "a2"]


def test_a_module_missing_from_the_durations_goes_first():
    items = [item("test_old.py", "o1"), item("test_new.py", "n1"), item("test_new.py", "n2")]
    ordered = longest_first(items, {"test_old.py": 600.0})
    assert [i.name for i in ordered] == ["n1", "n2", "o1"]


def test_the_durations_file_names_existing_modules_only():
    """A stale entry is harmless to the order but says the file was not regenerated."""
    modules = {p.name for p in DURATIONS.parent.glob("test_*.py")}
    recorded = json.loads(DURATIONS.read_text())
    assert set(recorded) <= modules, f"{DURATIONS.name} names modules that are gone: {set(recorded) - modules}"
    assert all(isinstance(v, (int, float)) and v >= 0 for v in recorded.values())
