"""Files that run on the remote host. They are sent over stdin, never imported there."""

from pathlib import Path

REMOTE_DIR = Path(__file__).resolve().parent
