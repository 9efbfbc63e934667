"""Prometheus metrics, named after vLLM's (`vllm:` -> `pie:`) where vLLM has one, labelled by
model and, where a run has one, inferlet. Each server has its own registry, so two servers in
one process (the tests) count apart."""

from __future__ import annotations

from typing import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..engine.loop import LoopStats
from ..runtime.runtime import RunResult

# vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards built for it read these too
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model: str):
        self.registry = r = CollectorRegistry()
        self.model = model
        by_run = ["model_name", "inferlet"]
        self.requests = Counter("pie:http_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self._running = Gauge("pie:num_requests_running", "Inferlet instances running",
                              ["model_name"], registry=r).labels(model)
        self._waiting = Gauge("pie:num_requests_waiting", "Requests queued for an instance slot (--max-queue)",
                              ["model_name"], registry=r).labels(model)
        self.prompt_tokens = Counter("pie:prompt_tokens", "Prompt tokens of the completions that started",
                                     by_run, registry=r)
        self.generation_tokens = Counter("pie:generation_tokens", "Tokens generated", by_run, registry=r)
        self.ttft = Histogram("pie:time_to_first_token_seconds", "From a request's arrival (queueing included) "
                              "to its first text", by_run, buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("pie:time_per_output_token_seconds", "A run's time per token after its first",
                              by_run, buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("pie:e2e_request_latency_seconds", "From a request's arrival to its run's end",
                             by_run, buckets=E2E_BUCKETS, registry=r)
        # speculative decoding, as vLLM counts it (a draft: one round that verified at least one draft token)
        self.spec_drafts = Counter("pie:spec_decode_num_drafts", "Rounds that verified drafts", by_run, registry=r)
        self.spec_draft_tokens = Counter("pie:spec_decode_num_draft_tokens", "Draft tokens verified",
                                         by_run, registry=r)
        self.spec_accepted = Counter("pie:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                     by_run, registry=r)
        self.spec_accepted_per_pos = Counter("pie:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, by their position in the draft",
                                             by_run + ["position"], registry=r)

    def watch(self, running: Callable[[], int], waiting: Callable[[], int]) -> None:
        """Read the gauges from admission at each scrape: they cannot drift from it."""
        self._running.set_function(running)
        self._waiting.set_function(waiting)

    def watch_prefix_cache(self, cache) -> None:
        """Export the engine's prefix cache counters (prefix_cache.py), read at each scrape."""
        self.registry.register(_PrefixCacheCounters(self.model, cache))

    def watch_suffix_index(self, store) -> None:
        """Export the engine's suffix index (suffix_index.py): its size and lookups, read at each scrape."""
        self.registry.register(_SuffixIndexMetrics(self.model, store))

    def started(self, inferlet: str, prompt_tokens: int) -> None:
        self.prompt_tokens.labels(self.model, inferlet).inc(prompt_tokens)

    def ended(self, inferlet: str, result: RunResult, drafts: LoopStats | None, first: float | None,
              e2e: float) -> None:
        """A run has returned: its tokens, latencies (`first` and `e2e` in seconds from arrival,
        `first` None without text) and the draft counts the host kept for it."""
        labels = (self.model, inferlet)
        n = len(result.token_ids)
        self.generation_tokens.labels(*labels).inc(n)
        self.e2e.labels(*labels).observe(e2e)
        if first is not None:
            self.ttft.labels(*labels).observe(first)
            if n > 1:
                self.tpot.labels(*labels).observe((e2e - first) / (n - 1))
        if drafts is not None and drafts.drafted:
            self.spec_drafts.labels(*labels).inc(drafts.drafted_by_position[0])
            self.spec_draft_tokens.labels(*labels).inc(drafts.drafted)
            self.spec_accepted.labels(*labels).inc(drafts.accepted)
            for pos, accepted in enumerate(drafts.accepted_by_position):
                self.spec_accepted_per_pos.labels(*labels, str(pos)).inc(accepted)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PrefixCacheCounters:
    """vLLM's prefix cache counters, in tokens: those of the prompt passes looked up, those found."""

    def __init__(self, model: str, cache):
        self.model, self.cache = model, cache

    def collect(self):
        for name, doc, value in (
                ("pie:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", self.cache.queries),
                ("pie:prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed)", self.cache.hits)):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model], value)
            yield family


class _SuffixIndexMetrics:
    """The suffix index of cross-request drafts, over every namespace: its size and its lookups."""

    def __init__(self, model: str, store):
        self.model, self.store = model, store

    def collect(self):
        st = self.store
        for kind, name, doc, value in (
                (GaugeMetricFamily, "pie:suffix_index_tokens", "Tokens of earlier requests listed for drafts", st.tokens),
                (GaugeMetricFamily, "pie:suffix_index_documents", "Texts (prompt and output) listed for drafts", len(st)),
                (CounterMetricFamily, "pie:suffix_index_evictions", "Texts evicted from the suffix index", st.evictions),
                (CounterMetricFamily, "pie:suffix_index_lookups", "Drafts asked of the suffix index", st.lookups),
                (CounterMetricFamily, "pie:suffix_index_hits", "Lookups of the suffix index that drafted", st.hits),
                (CounterMetricFamily, "pie:suffix_index_drafted_tokens", "Tokens the suffix index drafted",
                 st.drafted)):
            family = kind(name, doc, labels=["model_name"])
            family.add_metric([self.model], value)
            yield family
