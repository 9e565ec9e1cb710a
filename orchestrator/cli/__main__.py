"""`python -m orchestrator.cli`: the same entry point as the `sglfleet` script."""

from . import main

main()
