"""Prometheus text-format metrics with vLLM's names, so existing vLLM dashboards and alerts work unchanged, and the
process gauges (memory, CPU time, file descriptors) with the names Prometheus' client libraries give them.

Written by hand (counters, gauges, histograms in the text exposition format 0.0.4) to avoid a dependency; all
updates take one lock because the engine thread writes while the HTTP thread scrapes.
"""

from __future__ import annotations

import bisect
import os
import threading
from collections.abc import Callable

# vLLM's bucket boundaries for the same histograms
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
PREFIX = "vllm:"


class _Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # last = +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1


class Metrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.lock = threading.Lock()
        self.counters: dict[str, float] = {
            "prompt_tokens_total": 0,
            "generation_tokens_total": 0,
            "request_success_total": 0,
            "request_cancelled_total": 0,
            "request_rejected_total": 0,
            "prefix_cache_queries_total": 0,
            "prefix_cache_hits_total": 0,
            "num_preemptions_total": 0,
        }
        self.finish_reasons: dict[str, int] = {}
        self.hist = {
            "time_to_first_token_seconds": _Histogram(TTFT_BUCKETS),
            "inter_token_latency_seconds": _Histogram(ITL_BUCKETS),
            "e2e_request_latency_seconds": _Histogram(E2E_BUCKETS),
        }
        # gauges are read from the engine at scrape time
        self.gauges: dict[str, Callable[[], float]] = {}
        self.help = {
            "num_requests_running": "Number of requests in the running batch (one KV-cache row each).",
            "num_requests_waiting": "Number of requests waiting in the queue.",
            "kv_rows_in_use": "KV-cache rows held by running sequences.",
            "prompt_tokens_total": "Number of prefill tokens processed.",
            "generation_tokens_total": "Number of generation tokens processed.",
            "request_success_total": "Count of successfully finished requests.",
            "request_cancelled_total": "Requests cancelled (client disconnected) while queued or running.",
            "request_rejected_total": "Requests rejected with 429 because the queue was full.",
            "prefix_cache_queries_total": "Prefix cache queries, in prompt tokens.",
            "prefix_cache_hits_total": "Prefix cache hits, in prompt tokens (keys and values reused, not computed).",
            "num_preemptions_total": "Cumulative number of preemptions: running sequences that gave their paged KV "
            "blocks back to be computed again later.",
            "kv_cache_usage_perc": "KV-cache usage (0-1): positions held by running sequences over all positions; a paged cache: "
            "blocks in use over all blocks",
            "time_to_first_token_seconds": "Histogram of time to first token in seconds.",
            "inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
            "e2e_request_latency_seconds": "Histogram of end-to-end request latency in seconds.",
        }

    def speculating(self) -> None:
        """Add speculative decoding's counters (vLLM's names)."""
        for name, text in (
            ("spec_decode_num_drafts_total", "Number of spec decoding drafts."),
            ("spec_decode_num_draft_tokens_total", "Number of draft tokens."),
            ("spec_decode_num_accepted_tokens_total", "Number of accepted tokens."),
        ):
            self.counters.setdefault(name, 0)
            self.help[name] = text

    def inc(self, name: str, v: float = 1) -> None:
        with self.lock:
            self.counters[name] += v

    def observe(self, name: str, v: float) -> None:
        with self.lock:
            self.hist[name].observe(v)

    def finished(self, reason: str) -> None:
        with self.lock:
            self.counters["request_success_total"] += 1
            self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1

    def render(self) -> str:
        lab = f'model_name="{self.model_name}"'
        out: list[str] = []

        def head(name, kind):
            out.append(f"# HELP {PREFIX}{name} {self.help.get(name, name)}")
            out.append(f"# TYPE {PREFIX}{name} {kind}")

        for name, fn in self.gauges.items():
            head(name, "gauge")
            out.append(f"{PREFIX}{name}{{{lab}}} {float(fn())}")
        with self.lock:
            for name, v in self.counters.items():
                head(name, "counter")
                if name == "request_success_total" and self.finish_reasons:
                    for reason, c in sorted(self.finish_reasons.items()):
                        out.append(f'{PREFIX}{name}{{finished_reason="{reason}",{lab}}} {float(c)}')
                else:
                    out.append(f"{PREFIX}{name}{{{lab}}} {float(v)}")
            for name, h in self.hist.items():
                head(name, "histogram")
                cum = 0
                for b, c in zip(h.buckets + (float("inf"),), h.counts, strict=True):
                    cum += c
                    le = "+Inf" if b == float("inf") else repr(float(b))
                    out.append(f'{PREFIX}{name}_bucket{{le="{le}",{lab}}} {float(cum)}')
                out.append(f"{PREFIX}{name}_sum{{{lab}}} {h.sum}")
                out.append(f"{PREFIX}{name}_count{{{lab}}} {float(h.count)}")
        return "\n".join(out + process_metrics()) + "\n"


def process_metrics() -> list[str]:
    """The serving process's gauges as Prometheus' client libraries name them (process_*), read from /proc on
    Linux; elsewhere only the CPU time, which the OS reports everywhere."""
    t = os.times()
    cpu = t.user + t.system
    rows = [("cpu_seconds_total", "counter", "Total user and system CPU time spent in seconds.", cpu)]
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read().rsplit(b")", 1)[1].split()  # the fields after the command name
        with open("/proc/stat", "rb") as f:
            btime = next(float(ln.split()[1]) for ln in f if ln.startswith(b"btime "))
        page, ticks = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_CLK_TCK")
        rows += [
            ("virtual_memory_bytes", "gauge", "Virtual memory size in bytes.", float(stat[20])),
            ("resident_memory_bytes", "gauge", "Resident memory size in bytes.", float(stat[21]) * page),
            ("start_time_seconds", "gauge", "Start time of the process since unix epoch in seconds.",
             btime + float(stat[19]) / ticks),
            ("open_fds", "gauge", "Number of open file descriptors.", float(len(os.listdir("/proc/self/fd")))),
            ("max_fds", "gauge", "Maximum number of open file descriptors.", float(_max_fds())),
        ]  # fmt: skip
    except (OSError, ValueError, IndexError, StopIteration):
        pass  # not Linux (or /proc not mounted)
    out = []
    for name, kind, text, v in rows:
        out += [f"# HELP process_{name} {text}", f"# TYPE process_{name} {kind}", f"process_{name} {v}"]
    return out


def _max_fds() -> int:
    import resource  # Unix only: imported where /proc was readable

    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def render_many(metrics: list[Metrics]) -> str:
    """Several engines' metrics (one per served model, told apart by their model_name label) as one exposition:
    each metric's HELP and TYPE once, then every model's samples."""
    families: dict[str, list[str]] = {}
    for m in metrics:
        name = None
        for line in m.render().splitlines():
            if line.startswith("# HELP "):
                name = line.split(" ", 3)[2]
                fresh = name not in families
                families.setdefault(name, [])
            if fresh or not line.startswith("#"):
                families[name].append(line)
    return "".join(line + "\n" for lines in families.values() for line in lines)


def parse_metrics(text: str) -> dict[str, float]:
    """{'name{labels}': value} from Prometheus text (used by tests and the load benchmark)."""
    res = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, val = line.rpartition(" ")
            res[key] = float(val)
    return res
