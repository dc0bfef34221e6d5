"""pdserve's metrics, one definition for every process: prometheus-client on its own registry
(served on a node's --metrics-port), or ray.util.metrics inside Ray Serve replicas (the same
names, through Ray's metrics agent). Names follow Prometheus conventions; docs/metrics.md lists
them with their meaning.
"""

from __future__ import annotations

import prometheus_client as prom

# Latency buckets from 1 ms to 2 min, roughly x2.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
)
BYTES_BUCKETS = tuple(float(1 << k) for k in range(10, 34, 2))  # 1 KiB .. 8 GiB
OUTCOMES = ("ok", "cancelled", "invalid", "unavailable", "timeout", "error")

# name: (kind, description, labels, buckets)
DEFINITIONS = {
    # router: what a client sees
    "pdserve_request_ttft_seconds": (
        "histogram",
        "Time to first token, from the router receiving the request",
        (),
        LATENCY_BUCKETS,
    ),
    "pdserve_request_tpot_seconds": (
        "histogram",
        "Time per output token after the first (inter-token latency)",
        (),
        LATENCY_BUCKETS,
    ),
    "pdserve_request_e2e_seconds": ("histogram", "End-to-end request latency", (), LATENCY_BUCKETS),
    "pdserve_request_queue_seconds": (
        "histogram",
        "From the router receiving a request to its prefill starting",
        (),
        LATENCY_BUCKETS,
    ),
    "pdserve_requests_total": ("counter", "Requests by outcome", ("outcome",), None),
    "pdserve_prompt_tokens_total": ("counter", "Prompt tokens of requests served", (), None),
    "pdserve_generation_tokens_total": ("counter", "Tokens generated", (), None),
    "pdserve_migrations_total": ("counter", "Requests moved to another node after their decode side failed", (), None),
    "pdserve_prefills_total": (
        "counter",
        "Prefills by where they ran: the prefill pool (remote) or the request's "
        "decode node (local: conditional disaggregation)",
        ("where",),
        None,
    ),
    "pdserve_decode_node_tpot_seconds": (
        "gauge",
        "A decode node's recent time per output token as the router sees its streams (the local "
        "prefill TPOT bound's measure), at the router's last placement there",
        ("node",),
        None,
    ),
    "pdserve_node_outstanding_requests": (
        "gauge",
        "Requests this router has in flight on a node",
        ("role", "node"),
        None,
    ),
    # nodes
    "pdserve_prefill_compute_seconds": (
        "histogram",
        "Prefill time of a request on its prefill node (queue + forward)",
        (),
        LATENCY_BUCKETS,
    ),
    "pdserve_kv_transfer_seconds": (
        "histogram",
        "KV transfer time, prefill node to decode node",
        ("transport",),
        LATENCY_BUCKETS,
    ),
    "pdserve_kv_transfer_bytes": ("histogram", "KV bytes per transfer", ("transport",), BYTES_BUCKETS),
    "pdserve_kv_transfer_gbps": ("gauge", "Throughput of the latest KV transfer (GB/s)", ("transport",), None),
    "pdserve_engine_step_seconds": (
        "histogram",
        "One engine step (a batched forward and sampling)",
        ("role",),
        LATENCY_BUCKETS,
    ),
    "pdserve_waiting_sequences": ("gauge", "Sequences waiting in the engine", ("role",), None),
    "pdserve_running_sequences": ("gauge", "Sequences running in the engine", ("role",), None),
    "pdserve_kv_blocks_used": ("gauge", "KV blocks in use (sequences and leases)", ("role",), None),
    "pdserve_kv_blocks_total": ("gauge", "KV blocks in the pool", ("role",), None),
    "pdserve_node_outstanding": (
        "gauge",
        "Requests open on this node (prefills pending, decode streams)",
        ("role",),
        None,
    ),
    "pdserve_preemptions_total": (
        "counter",
        "Sequences preempted (recomputed later) for lack of KV blocks",
        ("role",),
        None,
    ),
    "pdserve_engine_tokens_total": (
        "counter",
        "Tokens through the engine: prompt tokens in, generated out",
        ("role", "direction"),
        None,
    ),
    "pdserve_prefix_cache_query_tokens_total": (
        "counter",
        "Tokens of admitted sequences looked up in the prefix cache",
        ("role",),
        None,
    ),
    "pdserve_prefix_cache_hit_tokens_total": (
        "counter",
        "Tokens whose KV the prefix cache already held",
        ("role",),
        None,
    ),
    "pdserve_prefix_cache_blocks": (
        "gauge",
        "KV blocks named in the prefix cache (in use or evictable)",
        ("role",),
        None,
    ),
    "pdserve_prefix_cache_evicted_blocks_total": ("counter", "Cached KV blocks evicted to make room", ("role",), None),
    "pdserve_spec_decode_verifications_total": (
        "counter",
        "Verification steps: one sequence's drafts checked in a forward",
        ("role",),
        None,
    ),
    "pdserve_spec_decode_draft_tokens_total": (
        "counter",
        "Tokens drafted by the speculative proposer",
        ("role",),
        None,
    ),
    "pdserve_spec_decode_accepted_tokens_total": (
        "counter",
        "Drafted tokens the target model accepted",
        ("role",),
        None,
    ),
    "pdserve_spec_decode_acceptance_rate": ("gauge", "Accepted / drafted tokens since start", ("role",), None),
    "pdserve_spec_decode_tokens_per_verification": (
        "gauge",
        "Tokens emitted per verification step since start (accepted drafts + 1)",
        ("role",),
        None,
    ),
}


class Metrics:
    """The metrics of one server. backend "prometheus": a private CollectorRegistry (several
    servers may share a process, as in tests); backend "ray": ray.util.metrics."""

    def __init__(self, backend: str = "prometheus"):
        self.backend = backend
        self.registry = prom.CollectorRegistry() if backend == "prometheus" else None
        self._metrics: dict = {}

    def _get(self, name: str):
        if name not in self._metrics:
            kind, doc, labels, buckets = DEFINITIONS[name]
            if self.backend == "prometheus":
                cls = {"counter": prom.Counter, "gauge": prom.Gauge, "histogram": prom.Histogram}[kind]
                kwargs = {"buckets": buckets} if buckets else {}
                # prometheus-client adds _total to counters itself
                metric_name = name[: -len("_total")] if kind == "counter" else name
                self._metrics[name] = cls(metric_name, doc, labels, registry=self.registry, **kwargs)
            else:
                from ray.util import metrics as ray_metrics

                cls = {"counter": ray_metrics.Counter, "gauge": ray_metrics.Gauge, "histogram": ray_metrics.Histogram}[
                    kind
                ]
                kwargs = {"boundaries": list(buckets)} if buckets else {}
                self._metrics[name] = cls(name, doc, tag_keys=labels, **kwargs)
        return self._metrics[name]

    def _labelled(self, name: str, labels: dict):
        metric = self._get(name)
        if self.backend == "prometheus":
            return metric.labels(**labels) if labels else metric
        return metric

    def inc(self, name: str, value: float = 1.0, **labels) -> None:
        if value:
            m = self._labelled(name, labels)
            m.inc(value) if self.backend == "prometheus" else m.inc(value, tags=labels or None)

    def set(self, name: str, value: float, **labels) -> None:
        m = self._labelled(name, labels)
        m.set(value) if self.backend == "prometheus" else m.set(value, tags=labels or None)

    def observe(self, name: str, value: float, **labels) -> None:
        m = self._labelled(name, labels)
        m.observe(value) if self.backend == "prometheus" else m.observe(value, tags=labels or None)

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Exposes /metrics over HTTP (prometheus backend); returns the bound port."""
        server, _ = prom.start_http_server(port, addr=addr, registry=self.registry)
        return server.server_port

    def sample(self, name: str, **labels) -> float:
        """The current value of a counter or gauge, or a histogram's count (tests, benchmarks)."""
        kind = DEFINITIONS[name][0]
        metric_name = name[: -len("_total")] if kind == "counter" else name
        suffix = {"counter": "_total", "histogram": "_count", "gauge": ""}[kind]
        value = self.registry.get_sample_value(metric_name + suffix, labels or None)
        return value or 0.0


class EngineExporter:
    """Copies an engine's state into a server's metrics (each second, and on refresh()), and times
    its steps."""

    def __init__(self, metrics: Metrics, role: str, async_engine, outstanding):
        self.metrics, self.role, self.async_engine, self.outstanding = metrics, role, async_engine, outstanding
        self._seen = dict.fromkeys(
            ("preemptions", "in", "out", "query", "hit", "evicted", "verifications", "drafted", "accepted"), 0
        )
        async_engine.on_step = lambda seconds: metrics.observe("pdserve_engine_step_seconds", seconds, role=role)

    def refresh(self) -> None:
        m, role, engine = self.metrics, self.role, self.async_engine.engine
        load = engine.load()
        m.set("pdserve_waiting_sequences", load["num_waiting"], role=role)
        m.set("pdserve_running_sequences", load["num_running"], role=role)
        m.set("pdserve_kv_blocks_used", load["num_total_blocks"] - load["num_free_blocks"], role=role)
        m.set("pdserve_kv_blocks_total", load["num_total_blocks"], role=role)
        m.set("pdserve_node_outstanding", self.outstanding(), role=role)
        cache = engine.prefix_cache_stats()
        m.set("pdserve_prefix_cache_blocks", cache["cached_blocks"], role=role)
        totals = engine.counters()
        now = {
            "preemptions": totals["preemptions"],
            "in": totals["prompt_tokens"],
            "out": totals["generated_tokens"],
            "query": cache["query_tokens"],
            "hit": cache["hit_tokens"],
            "evicted": cache["evicted_blocks"],
            "verifications": totals["verifications"],
            "drafted": totals["draft_tokens"],
            "accepted": totals["accepted_tokens"],
        }
        seen = self._seen
        m.inc("pdserve_preemptions_total", now["preemptions"] - seen["preemptions"], role=role)
        m.inc("pdserve_engine_tokens_total", now["in"] - seen["in"], role=role, direction="in")
        m.inc("pdserve_engine_tokens_total", now["out"] - seen["out"], role=role, direction="out")
        m.inc("pdserve_prefix_cache_query_tokens_total", now["query"] - seen["query"], role=role)
        m.inc("pdserve_prefix_cache_hit_tokens_total", now["hit"] - seen["hit"], role=role)
        m.inc("pdserve_prefix_cache_evicted_blocks_total", now["evicted"] - seen["evicted"], role=role)
        if engine.config.speculative is not None:
            m.inc("pdserve_spec_decode_verifications_total", now["verifications"] - seen["verifications"], role=role)
            m.inc("pdserve_spec_decode_draft_tokens_total", now["drafted"] - seen["drafted"], role=role)
            m.inc("pdserve_spec_decode_accepted_tokens_total", now["accepted"] - seen["accepted"], role=role)
            if now["verifications"]:
                m.set("pdserve_spec_decode_acceptance_rate", now["accepted"] / now["drafted"], role=role)
                m.set(
                    "pdserve_spec_decode_tokens_per_verification",
                    (now["accepted"] + now["verifications"]) / now["verifications"],
                    role=role,
                )
        self._seen = now

    async def run(self, interval_s: float = 1.0) -> None:
        import asyncio

        while True:
            self.refresh()
            await asyncio.sleep(interval_s)
