"""The server's Prometheus metrics (`GET /metrics`)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily

from rbcompile.runtime.control.admission import QOS_CLASSES
from rbcompile.runtime.control.result_cache import ResultCache


class Metrics:
    """The server's Prometheus metrics, in a registry of their own."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("rbcompile_requests", "HTTP requests", ["endpoint", "status"], registry=r)
        self.latency = Histogram("rbcompile_request_seconds", "Request latency (to the last byte)",
                                 ["endpoint"], registry=r)
        self.ttft = Histogram("rbcompile_time_to_first_token_seconds",
                              "Streams: request start to the first token", registry=r)
        self.tokens = Counter("rbcompile_generated_tokens", "Tokens generated", registry=r)
        self.tokens_per_second = Gauge("rbcompile_tokens_per_second",
                                       "Generation speed of the last completion", registry=r)
        self.drafted = Counter("rbcompile_speculative_drafted_tokens", "Draft tokens verified", registry=r)
        self.accepted = Counter("rbcompile_speculative_accepted_tokens", "Draft tokens kept", registry=r)
        self.in_flight = Gauge("rbcompile_requests_in_flight", "Requests being served", registry=r)
        self.batch_rows = Gauge("rbcompile_batch_rows", "Rows in the running decode batch", registry=r)
        self.queued = Gauge("rbcompile_queued_requests", "Completions waiting for a batch row", registry=r)
        self.prefix_hit_rate = Gauge("rbcompile_prefix_cache_hit_rate",
                                     "Share of prompt tokens whose K/V came from the prefix cache", registry=r)
        self.prefix_bytes = Gauge("rbcompile_prefix_cache_bytes", "K/V bytes the prefix cache holds", registry=r)
        self.queued_by_qos = Gauge("rbcompile_queued_requests_by_qos", "Completions waiting, per QoS class",
                                   ["qos"], registry=r)
        self.refused = Counter("rbcompile_overload_refusals", "Requests refused with 503: shed (memory or "
                               "queue) or rejected (QoS class not admitted)", ["reason"], registry=r)
        self.watermark = Gauge("rbcompile_memory_watermark", "Memory watermark reached at the last "
                               "admission: 0 none, 1 shrink (60%), 2 protect (80%), 3 shed (95%)", registry=r)
        self.budget = Gauge("rbcompile_decode_budget", "Budget (skipped MLP share) the controller "
                            "sets for completions without their own", registry=r)
        self.weights_loss = Gauge("rbcompile_decode_weights_quality_loss", "Measured quality "
                                  "loss of the weight level the controller sets for completions "
                                  "without their own (0: the decoder's)", registry=r)
        self.result_hit_rate = Gauge("rbcompile_result_cache_hit_rate", "Share of embedding inputs "
                                     "answered from the result cache (exact repeats)", registry=r)
        self.result_bytes = Gauge("rbcompile_result_cache_bytes", "Bytes the result cache holds", registry=r)
        self.drafter = Counter("rbcompile_completions_by_drafter", "Completions by the speculation "
                               "they asked for", ["drafter"], registry=r)
        self.tier = Counter("rbcompile_consistency_tier", "Voted completions by samples tier (1, 3, "
                            "7; under auto, the router's choice)", ["tier"], registry=r)
        self.kv_bytes = Gauge("rbcompile_kv_cache_bytes", "K/V bytes of the running batch's cache "
                              "(an idle engine gives back all but one block)", registry=r)
        self.refused_by_client = Counter("rbcompile_client_refusals", "Requests refused with 429: "
                                         "their client held its share of the queue", registry=r)
        ProcessCollector(registry=r)   # process_resident_memory_bytes and the like
        self.steps = DrafterSteps()
        r.register(self.steps)
        self.engine = None

    def record_generation(self, tokens: int, seconds: float, drafted: int = 0, accepted: int = 0) -> None:
        self.tokens.inc(tokens)
        if seconds > 0:
            self.tokens_per_second.set(tokens / seconds)
        self.drafted.inc(drafted)
        self.accepted.inc(accepted)

    def refresh(self) -> None:
        """Labelled gauges read at a scrape."""
        if self.engine is not None:
            counts = self.engine.queued_by_priority()
            for priority, qos in enumerate(QOS_CLASSES):
                self.queued_by_qos.labels(qos).set(counts.get(priority, 0))

    def watch(self, engine) -> None:
        """Batch and queue gauges read from `engine` at each scrape."""
        self.engine = self.steps.engine = engine
        self.batch_rows.set_function(lambda: len(engine.running))
        self.budget.set_function(lambda: engine.budget or 0.0)
        self.weights_loss.set_function(
            lambda: (engine.levels.levels[engine.weights] if engine.weights
                     else engine.levels.default).loss)
        self.queued.set_function(lambda: engine.queued)
        self.kv_bytes.set_function(lambda: engine.cache.nbytes)
        if engine.prefix_cache is not None:
            self.prefix_hit_rate.set_function(lambda: engine.prefix_cache.stats.hit_rate)
            self.prefix_bytes.set_function(lambda: engine.prefix_cache.nbytes)

    def watch_results(self, cache: ResultCache) -> None:
        def hit_rate() -> float:
            stats = cache.stats
            looked_up = stats["hits"] + stats["misses"]
            return stats["hits"] / looked_up if looked_up else 0.0
        self.result_hit_rate.set_function(hit_rate)
        self.result_bytes.set_function(lambda: cache.nbytes)


class DrafterSteps:
    """A Prometheus collector: the engine's decode steps by the drafters whose drafts they
    verified ('off': none; under 'auto', the modes it chose)."""

    def __init__(self):
        self.engine = None

    def collect(self):
        counts = {} if self.engine is None else self.engine.stats.steps_by_drafter
        family = CounterMetricFamily("rbcompile_decode_steps_by_drafter", "Decode steps by the "
                                     "drafter that ran them (auto: the modes it chose)", labels=["drafter"])
        for mode, count in sorted(counts.items()):
            family.add_metric([mode], count)
        yield family
