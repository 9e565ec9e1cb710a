"""`sglfleet metrics`: DDTree / speculative decoding figures from SGLang's decode log lines.

SGLang logs, every `--decode-log-interval` decode steps, one line such as
    [2026-12-03 09:30:00 TP0] Decode batch, #running-req: 4, #token: 1280, token usage: 0.01,
    accept len: 3.41, accept rate: 0.81, cuda graph: True, gen throughput (token/s): 312.55, #queue-req: 0,
(hybrid models: `#full token`, `full token usage`, `mamba num`, `mamba usage` in place of the token
fields; older builds: `Decode batch.` and no accept rate). `parse_decode` reads any of these as
`key: value` fields, so a field added or dropped by another SGLang version costs nothing.

Round trips: the lines come from the `logs` read (`stages.logs.read_pages` with grep
`Decode batch`, filtered on the host, so only decode lines cross the wire); live mode is one
`scrape` call per host (remote/logs.py GETs /metrics on the host) parsed with prometheus_client.
Summary per host: median / p10 / p90 accept length and throughput; a host whose median accept
length is below OUTLIER_RATIO x the fleet's median is flagged (a wrong drafter looks like this).
"""

from __future__ import annotations

import csv
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ..errors import ConfigError
from ..fleet.remote_call import call
from .logs import SCRIPT, HostRead, Query, read_pages

DECODE = re.compile(r"Decode batch(?: \[(?P<iter>\d+)\])?(?P<sep>[.,])\s*(?P<fields>.*)$")
STAMP = re.compile(r"^\[(?P<date>\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2})(?P<ms>\.\d+)?(?P<ranks>(?: [A-Z]+\d+)*)\]")
DECODE_GREP = r"Decode batch"
OUTLIER_RATIO = 0.8
# SGLang's field label -> our column; values are numbers except cuda graph (a bool).
FIELDS = {
    "#running-req": "running_req", "#token": "tokens", "token usage": "token_usage",
    "#full token": "full_tokens", "full token usage": "full_token_usage",
    "#swa token": "swa_tokens", "swa token usage": "swa_token_usage",
    "mamba num": "mamba_num", "mamba usage": "mamba_usage",
    "accept len": "accept_len", "accept rate": "accept_rate", "cap len": "cap_len",
    "block accept len": "block_accept_len", "cuda graph": "cuda_graph",
    "gen throughput (token/s)": "gen_throughput", "#queue-req": "queue_req",
    "#prealloc-req": "prealloc_req", "#transfer-req": "transfer_req", "#retracted-req": "retracted_req",
    "pre-allocated usage": "preallocated_usage",
}
COLUMNS = ["host", "time", "epoch", "format", "ranks"] + list(dict.fromkeys(FIELDS.values()))
PLOTTED = {"accept_len": "accept length (tokens per forward)", "gen_throughput": "gen throughput (token/s)"}


@dataclass
class Decode:
    """One decode log line, parsed."""

    host: str
    epoch: float | None
    format: str  # "comma" (current), "period" (older `Decode batch.`)
    values: dict[str, Any] = field(default_factory=dict)
    ranks: str = ""

    def row(self) -> dict[str, Any]:
        when = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(self.epoch)) if self.epoch is not None else ""
        return {"host": self.host, "time": when, "epoch": self.epoch, "format": self.format, "ranks": self.ranks,
                **self.values}


def _value(text: str) -> Any:
    text = text.strip()
    if text in ("True", "False"):
        return text == "True"
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def parse_decode(host: str, text: str, epoch: float | None = None) -> Decode | None:
    """A `Decode batch` line -> Decode (None: not one). The line's own `[date]` stamp wins over
    `epoch` (the time the log reader gave it)."""
    match = DECODE.search(text)
    if not match:
        return None
    stamp = STAMP.match(text)
    ranks = ""
    if stamp:
        epoch = time.mktime(time.strptime(stamp.group("date"), "%Y-%m-%d %H:%M:%S")) + \
            (float(stamp.group("ms")) if stamp.group("ms") else 0.0)
        ranks = stamp.group("ranks").strip()
    values: dict[str, Any] = {}
    for part in match.group("fields").split(", "):
        label, colon, raw = part.rpartition(": ")
        label = label.strip().rstrip(",")
        if not colon:
            continue
        column = FIELDS.get(label)
        if column is None:  # a field of another version: kept under a safe name
            column = re.sub(r"[^a-z0-9]+", "_", label.lower()).strip("_")
            if not column:
                continue
        values[column] = _value(raw.rstrip(","))
    if "running_req" not in values:
        return None
    return Decode(host, epoch, "period" if match.group("sep") == "." else "comma", values, ranks)


def parse_lines(host: str, lines: Iterable[tuple[float | None, str]]) -> list[Decode]:
    found = []
    for epoch, text in lines:
        record = parse_decode(host, text, epoch)
        if record is not None:
            found.append(record)
    return found


def _quantiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "p10": None, "p90": None}
    if len(values) == 1:
        return {"median": values[0], "p10": values[0], "p90": values[0]}
    cuts = statistics.quantiles(values, n=10, method="inclusive")
    return {"median": statistics.median(values), "p10": cuts[0], "p90": cuts[-1]}


def summarize(records: dict[str, list[Decode]], ratio: float = OUTLIER_RATIO) -> dict[str, Any]:
    """Per host: lines, accept length and throughput quantiles, accept rate median; the fleet's
    median of host medians; hosts below ratio x that median flagged."""
    hosts: dict[str, Any] = {}
    for host, found in records.items():
        accept = [r.values["accept_len"] for r in found if isinstance(r.values.get("accept_len"), (int, float))]
        rate = [r.values["accept_rate"] for r in found if isinstance(r.values.get("accept_rate"), (int, float))]
        speed = [r.values["gen_throughput"] for r in found
                 if isinstance(r.values.get("gen_throughput"), (int, float))]
        epochs = [r.epoch for r in found if r.epoch is not None]
        hosts[host] = {"lines": len(found), "accept_len": _quantiles(accept), "gen_throughput": _quantiles(speed),
                       "accept_rate_median": statistics.median(rate) if rate else None,
                       "first": min(epochs) if epochs else None, "last": max(epochs) if epochs else None,
                       "flagged": False, "why": None}
    medians = [h["accept_len"]["median"] for h in hosts.values() if h["accept_len"]["median"] is not None]
    fleet = statistics.median(medians) if medians else None
    if fleet is not None and len(medians) >= 2:
        for host, h in hosts.items():
            mine = h["accept_len"]["median"]
            if mine is not None and mine < ratio * fleet:
                h["flagged"] = True
                h["why"] = (f"median accept length {mine:.2f} is {100 * (1 - mine / fleet):.0f}% below the fleet's "
                            f"{fleet:.2f} (threshold {ratio:g} x): check its drafter and speculative flags")
    return {"hosts": hosts, "fleet_accept_len_median": fleet, "ratio": ratio,
            "flagged": sorted(h for h, v in hosts.items() if v["flagged"])}


def write_csv(records: dict[str, list[Decode]], path: str | Path) -> int:
    """One row per decode line, every host, in time order; columns COLUMNS plus any unknown
    field seen. Returns the number of rows."""
    rows = sorted((r.row() for found in records.values() for r in found),
                  key=lambda row: (row["epoch"] if row["epoch"] is not None else float("-inf"), row["host"]))
    extra = sorted({k for row in rows for k in row} - set(COLUMNS))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS + extra, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return len(rows)


def plot(records: dict[str, list[Decode]], directory: str | Path, option: str = "--plot") -> dict[str, Any]:
    """One PNG per metric (PLOTTED): a line per host (each key of `records`) over time. Returns, per
    metric, the file and the points as matplotlib holds them after drawing (what the PNG shows)."""
    matplotlib = _optional("matplotlib", option)
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    charts: dict[str, Any] = {}
    for column, label in PLOTTED.items():
        figure, axes = plt.subplots(figsize=(10, 4.5), dpi=100)
        try:
            for host in sorted(records):
                points = [(r.epoch, r.values[column]) for r in records[host]
                          if r.epoch is not None and isinstance(r.values.get(column), (int, float))]
                if points:
                    xs = [mdates.date2num(_utc(e)) for e, _ in points]
                    axes.plot(xs, [v for _, v in points], marker=".", linewidth=1, label=host)
            axes.set_title(f"{label} per host")
            axes.set_ylabel(label)
            axes.set_xlabel("time (UTC)")
            axes.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
            axes.grid(True, alpha=0.3)
            if axes.lines:
                axes.legend(loc="best", fontsize="small")
            figure.autofmt_xdate()
            path = out / f"{column}.png"
            figure.savefig(path)
            charts[column] = {"file": str(path), "series": {
                line.get_label(): [[mdates.num2date(x).timestamp(), float(y)]
                                   for x, y in zip(line.get_xdata(), line.get_ydata())]
                for line in axes.lines}}
        finally:
            plt.close(figure)
    return charts


def _optional(module: str, option: str) -> Any:
    """An optional dependency, or one clear error saying how to get it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"{option} needs the Python package {module.replace('_', '-')}: "
                          f"pip install {module.replace('_', '-')} (into sglfleet's environment)") from None


def _utc(epoch: float) -> Any:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(epoch, tz=timezone.utc)


def collect(conn: Any, query: Query) -> tuple[list[Decode], HostRead]:
    """The host's decode lines (filtered on the host), parsed."""
    grep = DECODE_GREP if not query.grep else f"(?=.*{DECODE_GREP})(?:{query.grep})"
    state = HostRead(conn.host.name)
    narrowed = Query(query.profile, query.since, query.until, query.tail, grep, query.page_bytes, query.extra)
    found: list[Decode] = []
    for page in read_pages(conn, narrowed, None, state):
        found.extend(parse_lines(conn.host.name, ((line.ts, line.text) for line in page)))
    return found, state


# ---------------------------------------------------------------- live: /metrics

LIVE = {"sglang:spec_accept_length": "accept_len", "sglang:spec_accept_rate": "accept_rate",
        "sglang:gen_throughput": "gen_throughput", "sglang:num_running_reqs": "running_req",
        "sglang:num_queue_reqs": "queue_req", "sglang:token_usage": "token_usage"}


def prometheus_samples(text: str, option: str = "--live") -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text -> (sample name, labels, value), parsed by prometheus_client's own parser."""
    _optional("prometheus_client", option)
    from prometheus_client.parser import text_string_to_metric_families

    return [(sample.name, sample.labels, sample.value)
            for family in text_string_to_metric_families(text) for sample in family.samples]


def keyed(found: list[tuple[str, dict[str, str], float]]) -> dict[str, float]:
    """{sample name: value} for unlabeled samples and {name{labels}: value} for labeled ones."""
    values: dict[str, float] = {}
    for name, labels, value in found:
        if labels:
            name += "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
        values[name] = value
    return values


def parse_prometheus(text: str, option: str = "--live") -> dict[str, float]:
    """Prometheus text -> keyed samples (see keyed)."""
    return keyed(prometheus_samples(text, option))


def live_figures(values: dict[str, float]) -> dict[str, float | None]:
    """Our columns from a scrape: a gauge reported per label set (tp rank, model) is averaged."""
    out: dict[str, float | None] = {}
    for metric, column in LIVE.items():
        found = [v for k, v in values.items() if k == metric or k.startswith(metric + "{")]
        out[column] = sum(found) / len(found) if found else None
    return out


def scrape(conn: Any, query: Query) -> dict[str, Any]:
    answer = call(conn, SCRIPT, "scrape", {"profile": query.profile, **query.extra}, timeout=60)
    values = parse_prometheus(answer["text"])
    return {"url": answer["url"], "time": answer["now"], "figures": live_figures(values), "samples": len(values)}


def to_json(records: dict[str, list[Decode]]) -> dict[str, list[dict[str, Any]]]:
    return {host: [asdict(r) for r in found] for host, found in records.items()}
