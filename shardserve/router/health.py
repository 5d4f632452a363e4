"""Active health checks and load scraping. Every `probe_interval_s` each replica's /health is
probed (a half-open replica's probe decides whether it is readmitted), and each healthy
replica's /metrics is read for its queue, running batch and KV usage. Passive checks (failed or
stalled requests) feed the same circuit breaker from the forwarding code.

A probe unanswered after one probe interval, from a replica none of whose streams sent anything
meanwhile, makes the replica unresponsive (no new requests) at once; the probe's timeout
(`probe_timeout_s`) still decides whether that counts as a failure."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from shardserve.router.replica_pool import LoadSignals, Replica, ReplicaPool, ReplicaState
from shardserve.router.transport_errors import TRANSPORT_ERRORS

log = logging.getLogger(__name__)

LOAD_METRICS = {"vllm:num_requests_running": "num_running", "vllm:num_requests_waiting": "num_waiting",
                "vllm:kv_cache_usage_perc": "kv_usage"}


class HealthMonitor:
    def __init__(self, pool: ReplicaPool, client: httpx.AsyncClient, interval_s: float, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.pool, self.client, self.clock = pool, client, clock
        self.interval_s, self.timeout_s = interval_s, timeout_s

    async def run(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.interval_s)

    async def check_all(self) -> None:
        self.pool.reap()
        replicas = [r for r in self.pool.replicas.values()
                    if self.pool.due_for_probe(r, self.clock()) and r.state is not ReplicaState.EJECTED]
        await asyncio.gather(*(self.check(r) for r in replicas))

    async def check(self, replica: Replica) -> None:
        probe = asyncio.ensure_future(self.client.get(f"{replica.url}/health", timeout=self.timeout_s))
        try:
            await asyncio.wait({probe}, timeout=self.interval_s)
            if not probe.done() and not self._streaming(replica):
                if replica.responsive:
                    log.warning("replica %s does not answer its probe: no new requests until it does", replica.url)
                replica.responsive = False
            response = await probe
            healthy = response.status_code == 200
        except httpx.TimeoutException:
            # slow to answer but still streaming to us: busy, not dead
            healthy = self.clock() - replica.last_data_at < self.timeout_s
        except TRANSPORT_ERRORS:
            healthy = False
        finally:
            probe.cancel()
        if not healthy:
            was = replica.state
            self.pool.record_failure(replica, self.clock())
            if replica.state is ReplicaState.EJECTED and was is not ReplicaState.EJECTED:
                log.warning("replica %s ejected (failed probe; next probe in %.0f s)", replica.url, replica.eject_s)
            return
        readmitted = replica.state is ReplicaState.HALF_OPEN
        replica.responsive = True
        self.pool.record_success(replica)
        if readmitted:
            log.warning("replica %s readmitted", replica.url)
        await self.scrape(replica)

    def _streaming(self, replica: Replica) -> bool:
        """Whether one of its streams sent something within the last probe interval."""
        return self.clock() - replica.last_data_at < self.interval_s

    async def scrape(self, replica: Replica) -> None:
        try:
            if not replica.info:
                models = (await self.client.get(f"{replica.url}/v1/models", timeout=self.timeout_s)).json()
                replica.info = (models.get("data") or [{}])[0]
            text = (await self.client.get(f"{replica.url}/metrics", timeout=self.timeout_s)).text
        except (*TRANSPORT_ERRORS, ValueError):
            return  # load signals stay as they were; health is the probe's business
        replica.load = parse_load(text)


def parse_load(metrics_text: str) -> LoadSignals:
    load = LoadSignals(scraped_at=time.monotonic())
    for family in text_string_to_metric_families(metrics_text):
        field = LOAD_METRICS.get(family.name)
        if field is not None:
            setattr(load, field, sum(sample.value for sample in family.samples))
    return load
