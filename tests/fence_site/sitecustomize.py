"""Python loads this at start-up in every process the tests start with PYTHONPATH=tests/fence_site
(conftest.sglfleet): it installs the network fence (tests/netfence.py) in the CLI subprocess too."""

import os
import sys

if os.environ.get("SGLFLEET_TEST_FENCE_LOG"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        import netfence
    finally:
        del sys.path[0]
    netfence.install(os.environ["SGLFLEET_TEST_FENCE_LOG"])
