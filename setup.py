"""Build hook: the wheel carries templates/, playbooks/, patches/ and the kernels' sources inside
the package (the DDTree patchset ships kernels/ddtree/reference.py and ops.py).

They stay at the top of the repository (the project's layout), so `build_py` copies them into
`orchestrator/_bundled/` of the build; `orchestrator.data.data_dir` finds them there in an
installed wheel and at the top of the checkout otherwise (editable install, tests).
"""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

BUNDLED = ("templates", "playbooks", "patches", "kernels")


class BuildPyWithData(build_py):
    def run(self):
        super().run()
        here = os.path.dirname(os.path.abspath(__file__))
        for name in BUNDLED:
            target = os.path.join(self.build_lib, "orchestrator", "_bundled", name)
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(os.path.join(here, name), target,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "results", "tools"))


setup(cmdclass={"build_py": BuildPyWithData})
