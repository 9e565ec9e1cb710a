"""Small helpers of the tests that talk to a lab stand-in server over HTTP and wait on it."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request


def http(url, data=None, timeout=5):
    """(status, body) of a GET (or a JSON POST with `data`); (None, b"") when nothing answers."""
    request = urllib.request.Request(url, data=json.dumps(data).encode() if data is not None else None,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return None, b""


def wait_for(predicate, timeout=90, step=0.2):
    """The predicate's first truthy value within `timeout` s, else its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    return predicate()
