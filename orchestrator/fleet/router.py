"""HTTP client of the real SGLang router ("SGLang Model Gateway", PyPI `sglang-router`) and of a
worker's own load figure. No policy: the rollout (stages/rollout.py) decides what to do with it.

Each call is one HTTP request from this machine; every URL's host passes the loopback guard
(fleet/safety.check_target) before a socket is opened. The router API used (checked by hand with
sglang-router 0.3.2, see the serving-lifecycle notes):

    GET    /workers              {"workers": [{id, url, is_healthy, load, ...}], "total": n}
    POST   /workers {"url": U}   202 {"status": "accepted", "worker_id": UUID}  (added in the background)
    DELETE /workers/<UUID>       202; the worker leaves routing at once (a URL instead of the id is a 400)

A worker's in-flight requests come from its own `/metrics` (`sglang:num_running_reqs` plus
`sglang:num_queue_reqs`): the router forgets a worker's `load` the moment it is removed.
"""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import quote, urlsplit

from ..errors import SglfleetError
from .safety import check_target

HTTP_TIMEOUT_S = 10.0


class RouterError(SglfleetError):
    """The router could not be reached, or answered something other than what its API says."""


@dataclass(frozen=True)
class Worker:
    id: str
    url: str
    healthy: bool
    load: int


def normalize_url(url: str) -> str:
    """http://HOST:PORT without a trailing slash: the form the router echoes back."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url


def check_http_url(value: Any) -> str:
    """`http://HOST:PORT` exactly (an optional trailing slash): the form a router or worker URL takes
    in the inventory. ValueError saying what is wrong otherwise."""
    text = str(value).strip() if isinstance(value, str) else None
    if not text:
        raise ValueError("must be a URL like http://HOST:PORT")
    if "://" not in text:
        raise ValueError("must be a URL like http://HOST:PORT (the http:// is missing)")
    parts = urlsplit(text)
    if parts.scheme != "http":
        raise ValueError(f"must be a URL like http://HOST:PORT (not {parts.scheme}://)")
    try:
        port = parts.port
    except ValueError:
        raise ValueError("must be a URL like http://HOST:PORT; its port is not a number from 1 to 65535") from None
    if not parts.hostname or port is None:
        raise ValueError("must be a URL like http://HOST:PORT, with the host and the port")
    if not 1 <= port <= 65535:
        raise ValueError("must be a URL like http://HOST:PORT; its port is not a number from 1 to 65535")
    if parts.username is not None or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError("must be a URL like http://HOST:PORT, with nothing after the port")
    return text


def _split(url: str, what: str) -> tuple[str, int, str]:
    parts = urlsplit(normalize_url(url))
    if parts.scheme != "http" or not parts.hostname:
        raise RouterError(f"{what} URL must look like http://HOST:PORT, got '{url}'")
    try:
        port = parts.port or 80
    except ValueError:
        raise RouterError(f"{what} URL has a bad port: '{url}'") from None
    return parts.hostname, port, parts.path.rstrip("/")


def request(url: str, method: str, path: str, body: Any = None, timeout: float = HTTP_TIMEOUT_S,
            what: str = "router") -> tuple[int, str]:
    """One HTTP request; (status, text). Refuses a non-loopback host under the guard."""
    host, port, prefix = _split(url, what)
    check_target(host, what)
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        connection.request(method, prefix + path, json.dumps(body) if body is not None else None, headers)
        response = connection.getresponse()
        return response.status, response.read().decode("utf-8", "replace")
    finally:
        connection.close()


class RouterClient:
    """One router: list, add and remove workers, and wait for the router to show a change."""

    def __init__(self, url: str, timeout: float = HTTP_TIMEOUT_S):
        self.url = normalize_url(url)
        _split(self.url, "router")
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"RouterClient({self.url})"

    def _call(self, method: str, path: str, body: Any = None, ok: tuple[int, ...] = (200,)) -> Any:
        try:
            status, text = request(self.url, method, path, body, self.timeout)
        except OSError as exc:
            raise RouterError(f"router {self.url}: {method} {path} failed: {type(exc).__name__}: {exc}") from None
        if status not in ok:
            raise RouterError(f"router {self.url}: {method} {path} answered HTTP {status}: {text[:300]}")
        try:
            return json.loads(text) if text.strip() else {}
        except ValueError:
            raise RouterError(f"router {self.url}: {method} {path} answered non-JSON: {text[:300]}") from None

    def workers(self) -> list[Worker]:
        doc = self._call("GET", "/workers")
        out = []
        for w in doc.get("workers") or []:
            out.append(Worker(id=str(w.get("id")), url=normalize_url(str(w.get("url"))),
                              healthy=bool(w.get("is_healthy")), load=int(w.get("load") or 0)))
        return out

    def find(self, worker_url: str) -> Worker | None:
        wanted = normalize_url(worker_url)
        for w in self.workers():
            if w.url == wanted:
                return w
        return None

    def add(self, worker_url: str) -> str:
        """Queue the worker's addition; returns the router's worker id."""
        doc = self._call("POST", "/workers", {"url": normalize_url(worker_url)}, ok=(200, 201, 202))
        return str(doc.get("worker_id") or "")

    def remove(self, worker_id: str) -> None:
        self._call("DELETE", "/workers/" + quote(worker_id, safe=""), ok=(200, 202, 204))

    def remove_url(self, worker_url: str) -> bool:
        """Remove the worker listed with this URL; False when the router does not list it."""
        worker = self.find(worker_url)
        if worker is None:
            return False
        self.remove(worker.id)
        return True

    def wait_absent(self, worker_url: str, timeout: float, interval: float = 0.1) -> float:
        """Seconds until the router no longer lists the worker; RouterError past `timeout`."""
        return _wait(lambda: self.find(worker_url) is None, timeout, interval,
                     f"router {self.url} still lists {worker_url} after {timeout:.0f}s")

    def wait_healthy(self, worker_url: str, timeout: float, interval: float = 0.1) -> float:
        """Seconds until the router lists the worker as healthy; RouterError past `timeout`."""
        def healthy() -> bool:
            w = self.find(worker_url)
            return w is not None and w.healthy
        return _wait(healthy, timeout, interval,
                     f"router {self.url} does not list {worker_url} as healthy after {timeout:.0f}s")

    def ensure(self, worker_url: str, timeout: float) -> float:
        """The worker listed and healthy (added if missing); seconds it took."""
        if self.find(worker_url) is None:
            self.add(worker_url)
        return self.wait_healthy(worker_url, timeout)


def _wait(done: Callable[[], bool], timeout: float, interval: float, message: str) -> float:
    started = time.monotonic()
    while True:
        if done():
            return time.monotonic() - started
        if time.monotonic() - started >= timeout:
            raise RouterError(message)
        time.sleep(interval)


# ---------------------------------------------------------------- the worker itself


def worker_in_flight(worker_url: str, timeout: float = 5.0) -> int | None:
    """Requests running or queued on the worker (its /metrics); None when it cannot say (no
    --enable-metrics, not listening)."""
    try:
        status, text = request(worker_url, "GET", "/metrics", timeout=timeout, what="worker")
    except OSError:
        return None
    if status != 200:
        return None
    total, seen = 0, False
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        base = name.split("{", 1)[0]
        if base in ("sglang:num_running_reqs", "sglang:num_queue_reqs"):
            try:
                total += int(float(value.split()[0]))
                seen = True
            except (ValueError, IndexError):
                continue
    return total if seen else None


def worker_healthy(worker_url: str, timeout: float = 5.0) -> bool:
    try:
        status, _ = request(worker_url, "GET", "/health", timeout=timeout, what="worker")
    except OSError:
        return False
    return status == 200
