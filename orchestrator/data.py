"""Where the project's data directories are: templates/, playbooks/, patches/, kernels/.

In a checkout (and an editable install) they are at the top of the repository; a built wheel
carries copies in `orchestrator/_bundled/` (setup.py's build step), so an installed sglfleet
works outside the repository.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def data_dir(name: str) -> Path:
    """`templates`, `playbooks`, `patches` or `kernels`: the bundled copy in an installed wheel."""
    bundled = PACKAGE_DIR / "_bundled" / name
    return bundled if bundled.is_dir() else PACKAGE_DIR.parent / name
