"""Prometheus metrics of one server, on a registry of its own (GET /metrics).

Names (all prefixed `deepinfer_`): `request_success_total{finished_reason}`, `num_requests_running`,
`num_requests_waiting`, `kv_cache_usage_perc` (0..1), `kv_cache_free_blocks`,
`prompt_tokens_total`, `generation_tokens_total`, `prefix_cache_queries_total` and
`prefix_cache_hits_total` (prompt tokens of finished requests looked up in / served from the prefix
cache; ignored requests count nothing), the prefix cache's host tier as of the engine's latest step
(`prefix_cache_host_hits_total`: prompt tokens whose KV came back from host memory,
`prefix_cache_host_spills_total`: KV blocks copied to host memory, `prefix_cache_host_blocks` and
`prefix_cache_host_snapshots`: held there now; all 0 without a host tier), on either server of a
prefill/decode pair `kv_transfers_total`, `kv_transfer_bytes_total` and `kv_transfer_seconds_total` (KV
handed over: sent by the prefill server, received by the decode server, whose time includes the
prefill), and the histograms
`time_to_first_token_seconds`, `inter_token_latency_seconds`, `e2e_request_latency_seconds`.

The gauges read the front's `stats`: with an engine process, the scheduler and KV cache as of the
engine's latest reported step (each step report carries them). With DP ranks (`parallel.DPAsyncLLM`)
the gauges above are sums over the ranks, and each rank has `dp_rank_num_requests_running{rank}`,
`dp_rank_num_requests_waiting{rank}`, `dp_rank_kv_cache_usage_perc{rank}` and
`dp_rank_requests_total{rank}` (requests sent to it). With
EPLB on: `eplb_rebalances_total`, and per MoE layer (forward order) the max / mean expert load of the
latest re-placement's window under the old and the new placement,
`eplb_layer_max_mean_load{layer, placement="before"|"after"}` (absent before the first re-placement,
and for the layers it left alone).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..core.stats import TransferStats
from ..frontends.async_front import EngineClient

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)


class ServerMetrics:
    """The metrics of one server; the gauges read `llm.stats` (the engine's last snapshot) when scraped."""

    def __init__(self, llm: EngineClient) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.finished = Counter("deepinfer_request_success", "Finished requests by finish reason",
                                ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("deepinfer_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("deepinfer_generation_tokens", "Generated tokens of finished requests",
                                         registry=r)
        self.prefix_cache_queries = Counter("deepinfer_prefix_cache_queries",
                                            "Prompt tokens of finished requests looked up in the prefix cache",
                                            registry=r)
        self.prefix_cache_hits = Counter("deepinfer_prefix_cache_hits",
                                         "Prompt tokens of finished requests served from the prefix cache", registry=r)
        self.ttft = Histogram("deepinfer_time_to_first_token_seconds", "Arrival to first output token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("deepinfer_inter_token_latency_seconds", "Time between output tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("deepinfer_e2e_request_latency_seconds", "Arrival to last output",
                             buckets=_LATENCY_BUCKETS, registry=r)
        gauges = {"deepinfer_num_requests_running": ("Requests decoding", lambda: llm.stats.num_running),
                  "deepinfer_num_requests_waiting": ("Requests accepted, not running", lambda: llm.stats.num_waiting),
                  "deepinfer_kv_cache_usage_perc": ("Fraction of KV blocks in use", lambda: llm.stats.kv_cache_usage),
                  "deepinfer_kv_cache_free_blocks": ("Free KV blocks", lambda: llm.stats.num_free_kv_blocks)}
        for name, (text, read) in gauges.items():
            Gauge(name, text, registry=r).set_function(read)
        r.register(_HostCacheCollector(llm))
        if llm.parallel_stats() is not None:
            r.register(_ParallelCollector(llm))
        # A prefill server's own counts are read live from its transfer (`pd_routes` sets this): its
        # engine's snapshot is taken at steps, and a handoff goes out after the step that made it.
        self.transfer_source: Callable[[], TransferStats | None] = lambda: llm.stats.kv_transfer
        r.register(_TransferCollector(self))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    def track(self) -> RequestTracker:
        """A tracker for one request arriving now."""
        return RequestTracker(self)


class _TransferCollector(Collector):
    """A prefill/decode pair's KV transfer counts (`EngineStats.kv_transfer`; nothing for a NORMAL engine)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        stats = self._metrics.transfer_source()
        if stats is None:
            return
        for name, text, value in (
                ("deepinfer_kv_transfers", "Requests whose KV was handed over (sent or received)", stats.num_transfers),
                ("deepinfer_kv_transfer_bytes", "KV and state bytes handed over", stats.num_bytes),
                ("deepinfer_kv_transfer_seconds", "Time spent handing KV over (decode side: prefill included)",
                 stats.seconds)):
            family = CounterMetricFamily(name, text)
            family.add_metric([], value)
            yield family


class _HostCacheCollector(Collector):
    """The prefix cache's host tier, read from `llm.stats` when scraped (its counters are the engine's)."""

    def __init__(self, llm: EngineClient) -> None:
        self._llm = llm

    def collect(self) -> Iterator[Metric]:
        host = self._llm.stats.host_cache
        yield CounterMetricFamily("deepinfer_prefix_cache_host_hits",
                                  "Prompt tokens whose KV blocks came back from the prefix cache's host memory",
                                  value=host.hits)
        yield CounterMetricFamily("deepinfer_prefix_cache_host_spills",
                                  "KV blocks copied to the prefix cache's host memory", value=host.spills)
        yield GaugeMetricFamily("deepinfer_prefix_cache_host_blocks",
                                "KV blocks held in the prefix cache's host memory", value=host.num_blocks)
        yield GaugeMetricFamily("deepinfer_prefix_cache_host_snapshots",
                                "State snapshots held in the prefix cache's host memory", value=host.num_snapshots)


class _ParallelCollector(Collector):
    """Per-rank gauges and EPLB re-placement stats, read from `llm.parallel_stats()` when scraped."""

    def __init__(self, llm: EngineClient) -> None:
        self._llm = llm

    def collect(self) -> Iterator[Metric]:
        stats = self._llm.parallel_stats()
        if stats is None:
            return
        per_rank = {"num_requests_running": ("Requests decoding on the DP rank", lambda s: s.num_running),
                    "num_requests_waiting": ("Requests accepted for the DP rank, not running", lambda s: s.num_waiting),
                    "kv_cache_usage_perc": ("Fraction of the DP rank's KV blocks in use", lambda s: s.kv_cache_usage)}
        for name, (text, read) in per_rank.items():
            family = GaugeMetricFamily(f"deepinfer_dp_rank_{name}", text, labels=["rank"])
            for rank, rank_stats in enumerate(stats.rank_stats):
                family.add_metric([str(rank)], read(rank_stats))
            yield family
        sent = CounterMetricFamily("deepinfer_dp_rank_requests", "Requests sent to the DP rank", labels=["rank"])
        for rank, num_requests in enumerate(stats.num_requests):
            sent.add_metric([str(rank)], num_requests)
        yield sent
        if not stats.eplb:
            return
        yield CounterMetricFamily("deepinfer_eplb_rebalances", "Expert re-placements adopted",
                                  value=len(stats.rebalances))
        load = GaugeMetricFamily("deepinfer_eplb_layer_max_mean_load",
                                 "Max / mean rank load per MoE layer over the latest re-placement's window",
                                 labels=["layer", "placement"])
        if stats.rebalances:
            last = stats.rebalances[-1]
            for layer, before, after in zip(last.layer_ids, last.max_mean_before, last.max_mean_after):
                load.add_metric([str(layer), "before"], before)
                load.add_metric([str(layer), "after"], after)
        yield load


class RequestTracker:
    """Times one request: feed it each output's new token count, then `finish` once."""

    __slots__ = ("_arrival", "_done", "_last", "_metrics")

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self._arrival = time.perf_counter()
        self._last: float | None = None      # time of the latest output with tokens
        self._done = False

    def on_tokens(self, num_new_tokens: int) -> None:
        """An output carrying num_new_tokens new tokens arrived: the first gives the TTFT; a later
        one spreads its interval evenly over its tokens (outputs coalesce when the consumer lags)."""
        if num_new_tokens <= 0:
            return
        now = time.perf_counter()
        if self._last is None:
            self._metrics.ttft.observe(now - self._arrival)
        else:
            gap = (now - self._last) / num_new_tokens
            for _ in range(num_new_tokens):
                self._metrics.itl.observe(gap)
        self._last = now

    def finish(self, reason: str, num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int = 0) -> None:
        """Count the request as finished with `reason` (once; later calls do nothing)."""
        if self._done:
            return
        self._done = True
        metrics = self._metrics
        metrics.finished.labels(finished_reason=reason).inc()
        metrics.prompt_tokens.inc(num_prompt_tokens)
        metrics.generation_tokens.inc(num_output_tokens)
        if reason != "ignored":
            metrics.prefix_cache_queries.inc(num_prompt_tokens)
            metrics.prefix_cache_hits.inc(num_cached_tokens)
        metrics.e2e.observe(time.perf_counter() - self._arrival)
