"""Prometheus metrics under vLLM's names, so existing dashboards and routers read them unchanged.

Each server owns its own CollectorRegistry (no process-global state). Counters are declared
without the `_total` suffix, which prometheus_client appends on exposition, as vLLM does:
`vllm:prompt_tokens` is scraped as `vllm:prompt_tokens_total`.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from shardserve.engine.engine import LLMEngine
from shardserve.request import RequestOutput
from shardserve.server.efficiency_metrics import EfficiencyConfig, LiveEfficiency

_LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                      7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)


class ServerMetrics:
    """`efficiency` adds the live MFU / MBU / cost-per-token gauges and the step-time histogram
    (efficiency_metrics.py); `num_speculative_tokens` > 0 vLLM's speculative decoding counters."""

    def __init__(self, model_name: str, efficiency: EfficiencyConfig | None = None, num_speculative_tokens: int = 0):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.num_running = Gauge("vllm:num_requests_running", "Requests in the running batch", labels, registry=r)
        self.num_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", labels, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1)", labels, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", labels, registry=r)
        self.request_success = Counter("vllm:request_success", "Finished requests", labels + ["finished_reason"], registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Preemptions", labels, registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Tokens looked up in the prefix cache", labels, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Tokens found in the prefix cache", labels, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", labels, buckets=_LATENCY_BUCKETS_S, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between tokens", labels, buckets=_LATENCY_BUCKETS_S, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency", labels, buckets=_LATENCY_BUCKETS_S, registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Time waiting before first scheduled", labels, buckets=_LATENCY_BUCKETS_S, registry=r)
        self.expert_tokens = Gauge("shardserve:expert_load_tokens", "Tokens routed to each expert since the last "
                                   "expert rebalance", labels + ["layer", "expert"], registry=r)
        self.expert_imbalance = Gauge("shardserve:expert_load_imbalance", "max / mean of the expert rows each "
                                      "rank computed since the last rebalance (1 = even)", labels + ["layer"], registry=r)
        self.expert_load_interval_s = 5.0
        self._last_expert_load = float("-inf")
        self.model_name = model_name
        # create every series up front, so a scrape shows them (at 0) before the first request
        for metric in (self.num_running, self.num_waiting, self.kv_usage, self.prompt_tokens, self.generation_tokens,
                       self.preemptions, self.prefix_queries, self.prefix_hits, self.ttft, self.itl, self.e2e,
                       self.queue_time):
            metric.labels(model_name)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(model_name, reason)
        self._last_token_time: dict[str, float] = {}
        self._seen = {"preemptions": 0, "queries": 0, "hits": 0}
        self.efficiency = LiveEfficiency(r, model_name, efficiency) if efficiency is not None else None
        self.spec = None
        if num_speculative_tokens:
            self.spec = {
                "num_drafts": Counter("vllm:spec_decode_num_drafts", "Verifications of proposed tokens", labels, registry=r),
                "num_draft_tokens": Counter("vllm:spec_decode_num_draft_tokens", "Proposed tokens", labels, registry=r),
                "num_accepted_tokens": Counter("vllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted",
                                               labels, registry=r)}
            self.spec_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Proposed tokens accepted, by position", labels + ["position"], registry=r)
            for counter in self.spec.values():
                counter.labels(model_name)
            for pos in range(num_speculative_tokens):
                self.spec_per_pos.labels(model_name, str(pos))
            self._seen.update({name: 0 for name in self.spec})
            self._seen.update({f"accepted_at_{pos}": 0 for pos in range(num_speculative_tokens)})
        self._last_step = None

    def observe_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        """Called from the engine thread after every step (and abort)."""
        m = self.model_name
        scheduler, blocks = engine.scheduler, engine.block_manager
        self.num_running.labels(m).set(scheduler.num_running)
        self.num_waiting.labels(m).set(scheduler.num_waiting)
        self.kv_usage.labels(m).set(blocks.usage)
        self._add_delta(self.preemptions, "preemptions", scheduler.num_preemptions)
        self._add_delta(self.prefix_queries, "queries", blocks.num_prefix_queries)
        self._add_delta(self.prefix_hits, "hits", blocks.num_prefix_hits)
        if self.spec is not None:
            self._observe_speculation(engine.speculator.stats)
        now = time.monotonic()
        for out in outputs:
            self._observe_output(out, now)
        # an abort also calls here, with the previous step's record: count each step once
        if self.efficiency is not None and engine.last_step is not None and engine.last_step is not self._last_step:
            self._last_step = engine.last_step
            self.efficiency.observe(engine.last_step, sum(len(out.new_token_ids) for out in outputs))
        if engine.model_config.is_moe and now - self._last_expert_load >= self.expert_load_interval_s:
            self._last_expert_load = now
            self._observe_expert_load(engine)

    def _observe_expert_load(self, engine: LLMEngine) -> None:
        """Expert load is gathered from every rank (a collective), so only every few seconds."""
        report = engine.expert_load()
        for layer, counts in report.routed.items():
            for expert, count in enumerate(counts):
                self.expert_tokens.labels(self.model_name, str(layer), str(expert)).set(count)
            self.expert_imbalance.labels(self.model_name, str(layer)).set(report.imbalance(layer))

    def _observe_speculation(self, stats) -> None:
        for name, counter in self.spec.items():
            self._add_delta(counter, name, getattr(stats, name))
        for pos, total in enumerate(stats.accepted_per_position):
            self._add_delta(self.spec_per_pos, f"accepted_at_{pos}", total, str(pos))

    def _add_delta(self, counter: Counter, key: str, total: int, *labels: str) -> None:
        if total > self._seen[key]:
            counter.labels(self.model_name, *labels).inc(total - self._seen[key])
            self._seen[key] = total

    def _observe_output(self, out: RequestOutput, now: float) -> None:
        m = self.model_name
        if out.new_token_ids:
            self.generation_tokens.labels(m).inc(len(out.new_token_ids))
            last = self._last_token_time.get(out.req_id)
            if last is None:  # the first token
                self.ttft.labels(m).observe(out.first_token_time - out.arrival_time)
                self.prompt_tokens.labels(m).inc(len(out.prompt_token_ids))
            else:
                self.itl.labels(m).observe(now - last)
            self._last_token_time[out.req_id] = now
        if out.finished:
            self._last_token_time.pop(out.req_id, None)
            self.request_success.labels(m, out.outputs[0].finish_reason or "abort").inc()
            self.e2e.labels(m).observe((out.finished_time or now) - out.arrival_time)
            if out.first_scheduled_time is not None:
                self.queue_time.labels(m).observe(out.first_scheduled_time - out.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
