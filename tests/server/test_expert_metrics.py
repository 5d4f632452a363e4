"""Per-expert load reaches Prometheus: every token a layer processes is routed to top-k experts."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from shardserve.config import CacheConfig, EngineConfig
from shardserve.engine.launcher import build_engine
from shardserve.request import SamplingParams
from shardserve.server.metrics import ServerMetrics


def test_expert_load_is_exported_per_layer_and_expert(tiny_checkpoints):
    engine = build_engine(EngineConfig(model=str(tiny_checkpoints["mixtral"]), show_progress=False,
                                    cache=CacheConfig(kv_cache_memory_bytes=1 << 22, enable_prefix_caching=False)))
    engine.add_request("a", [5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    metrics = ServerMetrics("tiny")
    metrics.observe_step(engine, [])
    samples = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    tokens = samples["shardserve:expert_load_tokens"]
    # 6 prompt tokens + 3 fed-back generated tokens (the 4th is never run), top-2, in each of 2 layers
    for layer in ("0", "1"):
        assert sum(s.value for s in tokens if s.labels["layer"] == layer) == (6 + 3) * 2
        assert len([s for s in tokens if s.labels["layer"] == layer]) == 8
    assert {s.labels["layer"] for s in samples["shardserve:expert_load_imbalance"]} == {"0", "1"}
