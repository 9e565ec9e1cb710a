"""Canary analysis: is the canary as fast as the fleet it would replace?

Modelled on Argo Rollouts' AnalysisRun and Flagger's analysis (figures read every interval, a
minimum of samples, a verdict of pass / fail / inconclusive; fail rolls back, inconclusive waits
for a human), but judged on what makes a speculative-decoding deploy fast, the draft's accept
length, and always canary vs baseline (the hosts still on what served before, observed over the
same window), never against a constant: accept length depends on the workload.

    Reading       one read of a server's /metrics: the gauges (accept length and rate, generation
                  throughput) and the counters (tokens generated, requests, their 5xx answers)
    Sample        one interval of one server in which it decoded (its token counter moved): the
                  gauges then; where /metrics is off, one decode log line with a running request
    Tally         a server's requests and failed requests over the whole window (counter deltas,
                  decoding or not: a canary that answers every request with a 500 decodes nothing)
    judge()       canary vs baseline under the profile's `analysis:` rules -> Verdict; pure
    decide()      what the rollout does with a verdict (continue, revert, pause); pure
    Observer      reads every server's /metrics each interval over the window, over HTTP from this
                  machine (as the rollout's drain reads in-flight requests): no SSH round trip
    from_decode_lines   where /metrics answers 404 (no --enable-metrics): the decode lines of the
                  window, read afterwards through stages.metrics (one `logs` read per such host)
    write_run     analysis.json and the charts (stages.metrics.plot) in the run directory
"""

from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..fleet.router import request
from ..spec.profile import Analysis
from . import metrics, runs

PASS, FAIL, INCONCLUSIVE, NA, SHOWN = "pass", "fail", "inconclusive", "n/a", "shown"
# What SGLang counts as a generation request (http_responses_total's endpoint label).
GENERATE_ENDPOINTS = ("/generate", "/v1/completions", "/v1/chat/completions")
# The figures compared by ratio: (Analysis field, Sample value, label in the table)
RATIO_METRICS = (("accept_length", "accept_len", "accept length"),
                 ("accept_rate", "accept_rate", "accept rate"),
                 ("throughput", "gen_throughput", "throughput (tok/s)"))


# ---------------------------------------------------------------- readings and samples (pure)


@dataclass
class Reading:
    """One read of a server's /metrics. Counters are None when the server does not export them."""

    at: float                              # wall clock (epoch s) of the read
    gauges: dict[str, float | None]        # accept_len, accept_rate, gen_throughput, running_req, ...
    tokens: float | None = None            # sglang:generation_tokens_total
    requests: float | None = None          # sglang:num_requests_total
    responses: float | None = None         # sglang:http_responses_total on GENERATE_ENDPOINTS
    errors: float | None = None            # ... of those with a 5xx status
    aborted: float | None = None           # sglang:num_aborted_requests_total


# The families a Reading uses (a counter under both its names: SGLang's text writes `_total`).
READ = {name + suffix for name in ("sglang:generation_tokens", "sglang:num_requests", "sglang:http_responses",
                                   "sglang:num_aborted_requests") for suffix in ("", "_total")} | set(metrics.LIVE)


def _read_lines(text: str) -> str:
    """Only the lines of the families READ: SGLang's /metrics is ~800 lines (histograms per label
    set), which prometheus_client parses in ~10 ms of CPU; these few lines in a fraction of it."""
    kept = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            name = parts[2] if len(parts) > 2 and parts[1] in ("HELP", "TYPE") else ""
        else:
            name = line.split("{", 1)[0].split(None, 1)[0] if line.strip() else ""
        if name in READ:
            kept.append(line)
    return "\n".join(kept) + "\n"


def reading(text: str, at: float) -> Reading:
    """A /metrics text as a Reading (prometheus_client's parser, through stages.metrics)."""
    found = metrics.prometheus_samples(_read_lines(text), "--canary")
    sums: dict[str, float] = {}
    for name, labels, value in found:
        if name == "sglang:http_responses_total":
            if labels.get("endpoint") not in GENERATE_ENDPOINTS:
                continue
            sums["responses"] = sums.get("responses", 0.0) + value
            if str(labels.get("status_code", "")).startswith("5"):
                sums["errors"] = sums.get("errors", 0.0) + value
            else:
                sums.setdefault("errors", 0.0)
        for counter, key in (("sglang:generation_tokens_total", "tokens"), ("sglang:num_requests_total", "requests"),
                             ("sglang:num_aborted_requests_total", "aborted")):
            if name == counter:
                sums[key] = sums.get(key, 0.0) + value
    return Reading(at=at, gauges=metrics.live_figures(metrics.keyed(found)), **sums)


@dataclass
class Sample:
    """One interval of one server in which it decoded: what it reported then."""

    host: str
    at: float                      # epoch seconds
    values: dict[str, float | None]
    source: str = "metrics"        # metrics | log


def _delta(before: float | None, after: float | None) -> float | None:
    """A counter's growth; None when either read lacks it or it went back (a restarted server)."""
    if before is None or after is None or after < before:
        return None
    return after - before


def decoded(before: Reading, after: Reading) -> bool:
    """Whether the server decoded between two reads: its generated-token counter moved (else its
    request counter; with neither, a running request at the second read). A counter that went
    back (the server restarted in between) says nothing was measured."""
    for key in ("tokens", "requests"):
        if getattr(before, key) is not None and getattr(after, key) is not None:
            return bool(_delta(getattr(before, key), getattr(after, key)))
    return bool(after.gauges.get("running_req"))


def sample_between(host: str, before: Reading, after: Reading) -> Sample | None:
    if not decoded(before, after):
        return None
    keep = ("accept_len", "accept_rate", "gen_throughput")
    return Sample(host, after.at, {k: after.gauges.get(k) for k in keep})


@dataclass
class Tally:
    """A server's generation requests and the failed ones (5xx; without the HTTP counter, the
    aborted ones) over the window. None: it exports neither counter."""

    requests: float | None = None
    errors: float | None = None

    def add(self, before: Reading, after: Reading) -> None:
        for total, failed in (("responses", "errors"), ("requests", "aborted")):
            n, bad = _delta(getattr(before, total), getattr(after, total)), \
                _delta(getattr(before, failed), getattr(after, failed))
            if n is not None and bad is not None:
                self.requests = (self.requests or 0.0) + n
                self.errors = (self.errors or 0.0) + bad
                return


def from_decode_lines(host: str, found: list[metrics.Decode], since: float, until: float) -> list[Sample]:
    """Decode log lines of the window as samples: SGLang logs one only while a batch runs; a line
    with no running request (the lab's stand-in logs those while idle) is not one."""
    out = []
    for d in found:
        if d.epoch is None or not since <= d.epoch <= until or not d.values.get("running_req"):
            continue
        out.append(Sample(host, d.epoch, {k: _number(d.values.get(k))
                                          for k in ("accept_len", "accept_rate", "gen_throughput")}, "log"))
    return out


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# ---------------------------------------------------------------- the verdict (pure)


@dataclass
class Side:
    """Canary or baseline: its hosts' samples pooled, and their tallies summed."""

    hosts: list[str]
    samples: list[Sample] = field(default_factory=list)
    requests: float | None = None
    errors: float | None = None

    @classmethod
    def of(cls, hosts: list[str], samples: dict[str, list[Sample]], tallies: dict[str, Tally]) -> "Side":
        side = cls(list(hosts))
        for h in hosts:
            side.samples.extend(samples.get(h) or [])
            t = tallies.get(h)
            if t is not None and t.requests is not None:
                side.requests = (side.requests or 0.0) + t.requests
                side.errors = (side.errors or 0.0) + (t.errors or 0.0)
        return side

    def values(self, key: str) -> list[float]:
        return [s.values[key] for s in self.samples if isinstance(s.values.get(key), (int, float))]

    def error_rate(self) -> float | None:
        return None if not self.requests else (self.errors or 0.0) / self.requests


@dataclass
class Verdict:
    verdict: str                       # pass | fail | inconclusive
    rows: list[dict[str, Any]]         # metric, canary, baseline, ratio, threshold, result, samples, why
    reasons: list[str]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _ratio_row(key: str, label: str, min_ratio: float | None, canary: Side, baseline: Side,
               min_samples: int) -> dict[str, Any]:
    c, b = canary.values(key), baseline.values(key)
    c_med = statistics.median(c) if c else None
    b_med = statistics.median(b) if b else None
    ratio = c_med / b_med if c_med is not None and b_med else None
    row = {"metric": label, "canary": c_med, "baseline": b_med, "ratio": ratio,
           "threshold": None if min_ratio is None else f">= {min_ratio:g}x baseline median",
           "samples": {"canary": len(c), "baseline": len(b)}, "result": SHOWN, "why": ""}
    decoding = (len(canary.samples), len(baseline.samples))
    if min_ratio is None:
        return row
    if min(decoding) < min_samples:
        return dict(row, result=INCONCLUSIVE, why=f"too few samples: the canary decoded in {decoding[0]} "
                    f"interval(s), the baseline in {decoding[1]}; analysis.min_samples is {min_samples}")
    if not b:
        return dict(row, result=NA, why=f"the baseline reports no {label}")
    if not c:
        return dict(row, result=FAIL, why=f"the canary decoded in {decoding[0]} interval(s) but reports no {label} "
                    f"(the baseline's median: {b_med:.4g})")
    if min(len(c), len(b)) < min_samples:
        return dict(row, result=INCONCLUSIVE, why=f"too few {label} samples: canary {len(c)}, baseline {len(b)}; "
                    f"analysis.min_samples is {min_samples}")
    if not b_med or b_med <= 0:
        return dict(row, result=NA, why=f"the baseline's median {label} is {b_med}: no ratio")
    assert ratio is not None
    if ratio >= min_ratio:
        return dict(row, result=PASS)
    return dict(row, result=FAIL, why=f"the canary's median {label} {c_med:.4g} is {ratio:.2f}x the baseline's "
                f"{b_med:.4g} (at least {min_ratio:g}x wanted)")


def _error_row(max_increase: float | None, canary: Side, baseline: Side, min_samples: int) -> dict[str, Any]:
    c, b = canary.error_rate(), baseline.error_rate()
    row = {"metric": "error rate", "canary": c, "baseline": b, "ratio": c / b if c is not None and b else None,
           "threshold": None if max_increase is None else f"<= baseline + {100 * max_increase:g} pp",
           "samples": {"canary": int(canary.requests or 0), "baseline": int(baseline.requests or 0)},
           "result": SHOWN, "why": ""}
    if max_increase is None:
        return row
    if canary.requests is None or baseline.requests is None:
        return dict(row, result=NA, why="no request counters (the servers' /metrics is off): not judged")
    if min(canary.requests, baseline.requests) < min_samples:
        return dict(row, result=INCONCLUSIVE, why=f"too few requests: canary {int(canary.requests)}, baseline "
                    f"{int(baseline.requests)}; analysis.min_samples is {min_samples}")
    assert c is not None and b is not None
    if c <= b + max_increase + 1e-12:
        return dict(row, result=PASS)
    return dict(row, result=FAIL, why=f"the canary failed {100 * c:.2f}% of {int(canary.requests)} request(s), the "
                f"baseline {100 * b:.2f}% (at most {100 * max_increase:g} percentage point(s) more wanted)")


def judge(canary: Side, baseline: Side, rules: Analysis) -> Verdict:
    """Canary vs baseline: a figure whose rule fails -> fail; otherwise a figure with too few
    samples -> inconclusive; otherwise pass. Nothing judged at all (every figure n/a) is
    inconclusive: no evidence is not a pass."""
    rows = [_ratio_row(key, label, getattr(rules, name).min_ratio, canary, baseline, rules.min_samples)
            for name, key, label in RATIO_METRICS]
    rows.append(_error_row(rules.error_rate.max_increase, canary, baseline, rules.min_samples))
    failed = [r for r in rows if r["result"] == FAIL]
    unsure = [r for r in rows if r["result"] == INCONCLUSIVE]
    if failed:
        return Verdict(FAIL, rows, [f"{r['metric']}: {r['why']}" for r in failed])
    if unsure:
        return Verdict(INCONCLUSIVE, rows, [f"{r['metric']}: {r['why']}" for r in unsure])
    if not any(r["result"] == PASS for r in rows):
        return Verdict(INCONCLUSIVE, rows, ["nothing could be judged: " + "; ".join(
            f"{r['metric']}: {r['why'] or 'not judged'}" for r in rows)])
    return Verdict(PASS, rows, [])


CONTINUE, REVERT, PAUSE = "continue", "revert", "pause"


def decide(verdict: str, mode: str, inconclusive: str) -> str:
    """What the rollout does next. mode "pause" (--analysis pause): always wait for a human
    (`sglfleet rollout continue` / `abort`); "auto": pass continues, fail reverts the canary, and
    inconclusive does what the profile's analysis.inconclusive says (pause, or fail: revert)."""
    if mode == PAUSE:
        return PAUSE
    if verdict == PASS:
        return CONTINUE
    if verdict == FAIL:
        return REVERT
    return PAUSE if inconclusive == PAUSE else REVERT


# ---------------------------------------------------------------- observing (HTTP from this machine)


class Observer:
    """Reads every server's /metrics at the start of the window and then every interval until it
    ends (the reads of one tick in parallel), keeping each server's samples and tally. A server
    answering 404 has its metrics off: it is left to the decode-log reading afterwards."""

    def __init__(self, urls: dict[str, str], window: float, interval: float, stop: threading.Event,
                 progress: Callable[[float, dict[str, int]], None] = lambda elapsed, counts: None):
        self.urls, self.window, self.interval, self.stop, self.progress = urls, window, interval, stop, progress
        self.samples: dict[str, list[Sample]] = {h: [] for h in urls}
        self.tallies: dict[str, Tally] = {h: Tally() for h in urls}
        self.last: dict[str, Reading] = {}
        self.metrics_off: set[str] = set()
        self.errors: dict[str, str] = {}
        self.reads = 0
        self.started_at = self.ended_at = 0.0

    def _read(self, host: str) -> None:
        try:
            status, text = request(self.urls[host], "GET", "/metrics", timeout=min(10.0, max(1.0, self.interval)),
                                   what="worker")
        except OSError as exc:
            self.errors[host] = f"{type(exc).__name__}: {exc}"
            return
        if status == 404:
            self.metrics_off.add(host)
            return
        if status != 200:
            self.errors[host] = f"/metrics answered HTTP {status}"
            return
        now = reading(text, time.time())
        before = self.last.get(host)
        if before is not None:
            found = sample_between(host, before, now)
            if found is not None:
                self.samples[host].append(found)
            self.tallies[host].add(before, now)
        self.last[host] = now

    def run(self) -> "Observer":
        began = time.monotonic()
        self.started_at = time.time()
        ticks = int(self.window // self.interval)
        with ThreadPoolExecutor(max_workers=min(16, max(1, len(self.urls)))) as pool:
            for tick in range(ticks + 1):
                due = began + tick * self.interval
                if self.stop.wait(max(0.0, due - time.monotonic())):
                    break
                hosts = [h for h in self.urls if h not in self.metrics_off]
                list(pool.map(self._read, hosts))
                self.reads += len(hosts)
                self.progress(time.monotonic() - began, {h: len(s) for h, s in self.samples.items()})
        self.ended_at = time.time()
        return self


# ---------------------------------------------------------------- the run directory


def charts(directory: Path, samples: dict[str, list[Sample]], roles: dict[str, str]) -> dict[str, Any]:
    """The window's accept length and throughput per host (labeled canary / baseline) as PNGs,
    drawn by stages.metrics.plot."""
    records = {f"{host} ({roles.get(host, '?')})": [metrics.Decode(host, s.at, "metrics", dict(s.values))
                                                    for s in found] for host, found in samples.items()}
    return metrics.plot(records, directory, "--canary")


def _import_plotting() -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
    except Exception:  # noqa: BLE001 - charts() says what is missing when it runs
        pass


def write_run(directory: Path, document: dict[str, Any]) -> Path:
    return runs.write_json(directory / "analysis.json", document)


# ---------------------------------------------------------------- one analysis, start to end

# (hosts, since, until) -> each host's decode lines: where /metrics is off (the rollout reads them
# through stages.metrics on its SSH connections).
LogReader = Callable[[list[str], float, float], dict[str, list[metrics.Decode]]]


def analyse(canary_hosts: list[str], baseline_hosts: list[str], urls: dict[str, str], rules: Analysis, window: float,
            stop: threading.Event, read_logs: LogReader, directory: Path,
            progress: Callable[[str], None] = lambda text: None) -> dict[str, Any]:
    """Observe both sides over the window, judge, and keep it all in `directory` (analysis.json
    with every sample, the charts). The document returned is what the rollout reports (--json)."""
    began, cpu = time.monotonic(), time.process_time()
    roles = {**{h: "canary" for h in canary_hosts}, **{h: "baseline" for h in baseline_hosts}}

    def tick(elapsed: float, counts: dict[str, int]) -> None:
        c = sum(counts.get(h, 0) for h in canary_hosts)
        b = sum(counts.get(h, 0) for h in baseline_hosts)
        progress(f"canary analysis {elapsed:.0f}s / {window:g}s: samples canary {c}, baseline {b}")

    # matplotlib's import (~1.5 s here) overlaps the window instead of following it: the charts come
    # after the verdict, on the rollout's path to its next batch.
    threading.Thread(target=_import_plotting, daemon=True).start()
    observer = Observer({h: urls[h] for h in roles}, window, rules.interval, stop, tick).run()
    samples = dict(observer.samples)
    log_errors: dict[str, str] = {}
    if observer.metrics_off and not stop.is_set():
        progress(f"canary analysis: /metrics is off on {', '.join(sorted(observer.metrics_off))}: reading their "
                 "decode log lines")
        try:
            lines = read_logs(sorted(observer.metrics_off), observer.started_at, observer.ended_at)
        except Exception as exc:  # noqa: BLE001 - said in the result; the verdict goes on without them
            lines, log_errors["*"] = {}, f"{type(exc).__name__}: {exc}"
        for host in observer.metrics_off:
            if host in lines:
                samples[host] = from_decode_lines(host, lines[host], observer.started_at, observer.ended_at)
            else:
                log_errors.setdefault(host, "its decode lines could not be read")
    tallies = {h: t for h, t in observer.tallies.items() if h not in observer.metrics_off}
    verdict = judge(Side.of(canary_hosts, samples, tallies), Side.of(baseline_hosts, samples, tallies), rules)
    doc: dict[str, Any] = {
        **verdict.to_json(), "canary": list(canary_hosts), "baseline": list(baseline_hosts),
        "window_s": window, "interval_s": rules.interval, "min_samples": rules.min_samples,
        "interrupted": stop.is_set(), "observed_s": round(observer.ended_at - observer.started_at, 3),
        "samples": {h: len(samples.get(h) or []) for h in roles},
        "source": {h: "decode log" if h in observer.metrics_off else "/metrics" for h in roles},
        "read_errors": {**observer.errors, **log_errors}, "reads": observer.reads, "run_dir": str(directory)}
    drawing, drawing_cpu = time.monotonic(), time.process_time()
    try:
        drawn = charts(directory, samples, roles)
        doc["charts"] = {metric: chart["file"] for metric, chart in drawn.items()}
    except Exception as exc:  # noqa: BLE001 - matplotlib missing or failing: the verdict stands without a chart
        doc["charts"] = {}
        doc["chart_error"] = f"{type(exc).__name__}: {exc}"
    doc["charts_s"] = round(time.monotonic() - drawing, 3)
    doc["charts_cpu_s"] = round(time.process_time() - drawing_cpu, 3)
    doc["seconds"] = round(time.monotonic() - began, 3)
    doc["cpu_s"] = round(time.process_time() - cpu, 3)  # the whole process meanwhile (the router watch too)
    write_run(directory, dict(doc, every_sample={h: [asdict(s) for s in found] for h, found in samples.items()},
                              tallies={h: asdict(t) for h, t in tallies.items()}, rules=rules.model_dump()))
    return doc
