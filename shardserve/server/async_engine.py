"""AsyncEngine: the engine's step loop on its own thread, one asyncio queue per request.

    HTTP handlers (event loop thread)               engine loop thread
    submit() --(commands: add / abort)-------------> drain, engine.step()
    RequestStream <--(call_soon_threadsafe)--------- outputs, per request

In a server the engine loop runs on the process's main thread (`run_forever`) and HTTP on a
second thread: torch's OpenMP pool is fastest when its parallel regions come from the main thread
(libgomp throttles its spin-waiting once more threads than cores take part, and a second thread
driving torch made every small op wait for a sleeping worker: decode steps ran 2x slower).
`start()` runs the loop on a background thread instead, for tests and embedding.

Tokenization and validation happen in the caller, so bad input fails in the handler (a 400) and
never reaches the engine thread. The waiting queue is bounded: `submit` refuses requests when the
requests not yet scheduled reach `max_waiting_requests`, and the server answers 429.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from shardserve.engine.engine import LLMEngine
from shardserve.request import RequestOutput, Resume, SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error; no request can be served."""


class QueueFullError(RuntimeError):
    """Too many requests are waiting; retry later."""


@dataclass
class RequestSpec:
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    resume: Resume | None = None


class RequestStream:
    """Async iterator over one request's outputs. Closing it early aborts the request."""

    def __init__(self, engine: "AsyncEngine", req_id: str):
        self._engine = engine
        self.req_id = req_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.finished = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        if item.finished:
            self.finished = True
            self._engine._streams.pop(self.req_id, None)
        return item

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine.abort(self.req_id)
        self._engine._streams.pop(self.req_id, None)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting_requests: int = 256,
                 on_step: Callable[[LLMEngine, list[RequestOutput]], None] | None = None):
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.on_step = on_step
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._num_pending = 0  # submitted, not yet handed to the scheduler
        self._num_waiting = 0  # the scheduler's waiting queue after the last step
        self._streams: dict[str, RequestStream] = {}
        self.last_progress_at = time.monotonic()  # the loop's last pass (a step, or idle)
        self._running = threading.Event()
        self._thread: threading.Thread | None = None

    # --- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Run the loop on a background thread."""
        self._thread = threading.Thread(target=self.run_forever, name="engine-loop", daemon=True)
        self._thread.start()

    def run_forever(self) -> None:
        """Run the loop on the calling thread until `stop()` or an engine error."""
        self._running.set()
        try:
            self._run()
        finally:
            self._running.clear()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self.stop()
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def is_alive(self) -> bool:
        return self.error is None and self._running.is_set()

    def making_progress(self, stuck_after_s: float) -> bool:
        """Alive, and its loop passed within `stuck_after_s` (not hung inside one step)."""
        return self.is_alive and time.monotonic() - self.last_progress_at < stuck_after_s

    # --- requests --------------------------------------------------------------------------------
    def submit(self, specs: list[RequestSpec]) -> list[RequestStream]:
        """Queue requests together (all or none). Raises EngineDeadError or QueueFullError."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        with self._lock:
            if self._num_waiting + self._num_pending + len(specs) > self.max_waiting_requests:
                raise QueueFullError(f"{self._num_waiting + self._num_pending} requests are already waiting")
            self._num_pending += len(specs)
        streams = []
        for spec in specs:
            stream = RequestStream(self, spec.req_id)
            self._streams[spec.req_id] = stream
            streams.append(stream)
            self._commands.put(("add", spec, time.monotonic()))
        self._wake.set()
        return streams

    def abort(self, req_id: str) -> None:
        self._commands.put(("abort", req_id, None))
        self._wake.set()

    # --- the engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.last_progress_at = time.monotonic()
                self._drain_commands()
                if not self.engine.has_unfinished_requests():
                    self.engine.keep_alive()
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                self._num_waiting = self.engine.scheduler.num_waiting
                for out in outputs:
                    self._deliver(out.req_id, out)
                if self.on_step is not None:
                    self.on_step(self.engine, outputs)
        except BaseException as exc:  # the loop must never die silently: fail every waiter
            log.exception("engine loop failed")
            self.error = exc
            for req_id in list(self._streams):
                self._deliver(req_id, EngineDeadError(f"engine failed: {exc}"))

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, payload, arrival = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "abort":
                out = self.engine.abort_request(payload)
                if out is not None and self.on_step is not None:
                    self.on_step(self.engine, [out])
                continue
            spec: RequestSpec = payload
            with self._lock:
                self._num_pending -= 1
            if spec.req_id not in self._streams:
                continue  # its client left before the engine saw it
            try:
                self.engine.add_request(spec.req_id, spec.prompt_token_ids, spec.params, spec.priority, arrival,
                                        spec.resume)
            except Exception as exc:  # validated by the caller; anything left is still its error
                self._deliver(spec.req_id, exc)
            self._num_waiting = self.engine.scheduler.num_waiting

    def _deliver(self, req_id: str, item) -> None:
        stream = self._streams.get(req_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
