"""A steady client load for the lab: fixed request rate, N concurrent clients, bounded in time
and in count, loopback only. Used by the rolling-restart tests and bench/rolling.py.

Requests are sent on a fixed schedule (request i at start + i / rate, open loop), each by the
next free of `clients` threads (one keep-alive HTTP connection each): a slow server makes
requests start late (counted as `late`), it never lowers the offered rate silently. A request
fails when it gets no HTTP answer, an answer other than 200, or a 200 without generated text.
Every request is kept (scheduled time, start, end, status, error) so a caller can cut the run
into phases (before / during / after a rollout) and compute latency percentiles per phase.
"""

from __future__ import annotations

import http.client
import json
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from ..fleet.safety import check_target


@dataclass
class Sample:
    scheduled: float   # monotonic seconds
    started: float
    ended: float
    status: int | None
    error: str | None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def latency(self) -> float:
        return self.ended - self.started


@dataclass
class LoadReport:
    started: float
    ended: float
    samples: list[Sample] = field(default_factory=list)
    late: int = 0  # requests that started more than 50 ms after their scheduled time

    def window(self, start: float | None = None, end: float | None = None) -> list[Sample]:
        """The requests scheduled in [start, end) (monotonic seconds; None: unbounded)."""
        return [s for s in self.samples if (start is None or s.scheduled >= start) and
                (end is None or s.scheduled < end)]

    @staticmethod
    def stats(samples: list[Sample]) -> dict[str, Any]:
        ok = sorted(s.latency for s in samples if s.ok)
        failed = [s for s in samples if not s.ok]
        kinds: dict[str, int] = {}
        for s in failed:
            key = (s.error or "?").split(":", 1)[0]
            kinds[key] = kinds.get(key, 0) + 1
        return {"requests": len(samples), "ok": len(ok), "failed": len(failed), "failures": kinds,
                "p50_ms": _pct(ok, 50), "p99_ms": _pct(ok, 99), "max_ms": round(ok[-1] * 1000, 1) if ok else None,
                "first_failures": [s.error for s in failed[:5]]}

    def summary(self) -> dict[str, Any]:
        return dict(self.stats(self.samples), seconds=round(self.ended - self.started, 3), late=self.late)


def _pct(sorted_values: list[float], pct: float) -> float | None:
    if not sorted_values:
        return None
    index = min(len(sorted_values) - 1, max(0, int(round(pct / 100.0 * len(sorted_values) + 0.5)) - 1))
    return round(sorted_values[index] * 1000, 1)


class LoadGenerator:
    """`start()`, then `stop()` (or let `duration` / `max_requests` end it); `report()`."""

    def __init__(self, url: str, rate: float, clients: int, duration: float, max_requests: int | None = None,
                 max_new_tokens: int = 8, timeout: float = 60.0, path: str = "/generate"):
        if rate <= 0 or clients < 1 or duration <= 0:
            raise ValueError("rate and duration must be positive and clients at least 1")
        parts = urlsplit(url if "://" in url else "http://" + url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"load target must be http://HOST:PORT, got {url!r}")
        check_target(parts.hostname, "load target")  # refuses anything outside 127.0.0.0/8 under the guard
        self.host, self.port = parts.hostname, parts.port or 80
        self.path, self.rate, self.clients, self.duration = path, rate, clients, duration
        self.max_requests = max_requests if max_requests is not None else int(rate * duration) + 1
        self.max_new_tokens, self.timeout = max_new_tokens, timeout
        self._queue: queue.Queue[float | None] = queue.Queue()
        self._samples: list[Sample] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._started = self._ended = 0.0

    def start(self) -> "LoadGenerator":
        self._started = time.monotonic()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(self.clients)]
        self._threads.append(threading.Thread(target=self._schedule, daemon=True))
        for t in self._threads:
            t.start()
        return self

    def _schedule(self) -> None:
        i = 0
        while not self._stop.is_set() and i < self.max_requests:
            due = self._started + i / self.rate
            if due - self._started >= self.duration:
                break
            delay = due - time.monotonic()
            if delay > 0 and self._stop.wait(delay):
                break
            self._queue.put(due)
            i += 1
        for _ in range(self.clients):
            self._queue.put(None)

    def _client(self, index: int) -> None:
        connection: http.client.HTTPConnection | None = None
        body = json.dumps({"text": f"lab load client {index}", "sampling_params":
                           {"max_new_tokens": self.max_new_tokens, "temperature": 0}})
        while True:
            due = self._queue.get()
            if due is None:
                break
            started = time.monotonic()
            status, error = None, None
            try:
                if connection is None:
                    connection = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
                connection.request("POST", self.path, body, {"Content-Type": "application/json"})
                response = connection.getresponse()
                status, text = response.status, response.read().decode("utf-8", "replace")
                if status != 200:
                    error = f"HTTP {status}: {text[:160]}"
                elif not (json.loads(text).get("text") or ""):
                    error = "empty: a 200 without generated text"
                if response.will_close:
                    connection.close()
                    connection = None
            except (OSError, http.client.HTTPException, ValueError) as exc:
                error = f"{type(exc).__name__}: {exc}"
                if connection is not None:
                    connection.close()
                connection = None
            sample = Sample(due, started, time.monotonic(), status, error)
            with self._lock:
                self._samples.append(sample)
        if connection is not None:
            connection.close()

    def stop(self) -> None:
        self._stop.set()

    def wait(self) -> "LoadReport":
        for t in self._threads:
            t.join()
        self._ended = time.monotonic()
        return self.report()

    def report(self) -> LoadReport:
        with self._lock:
            samples = sorted(self._samples, key=lambda s: s.scheduled)
        late = sum(1 for s in samples if s.started - s.scheduled > 0.05)
        return LoadReport(self._started, self._ended or time.monotonic(), samples, late)


def run_load(url: str, rate: float, clients: int, duration: float, **kwargs: Any) -> LoadReport:
    return LoadGenerator(url, rate, clients, duration, **kwargs).start().wait()
