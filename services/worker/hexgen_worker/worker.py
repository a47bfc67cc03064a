"""The worker process: its engine, its `WorkerState`, and its links to coordinators.

`Worker(config).run()` starts the engine, then keeps one link (`hexgen_worker.link`) to
every coordinator of the config (``--coordinator``, repeated for coordinator shards) for
as long as it runs. Every link feeds the one state: the calls of all coordinators wait in
one local queue, ordered together (by deadline with the default urgency queue), in front
of one engine; each call's reports go back on the link that dispatched it.

A link that breaks reconnects on its own (`CoordinatorLink.run`), the others go on. A
link the coordinator rejects (INVALID_ARGUMENT, FAILED_PRECONDITION, UNAUTHENTICATED), or
whose welcome the worker cannot serve, ends `run` with exit code 2; `stop()`
(SIGTERM/SIGINT in the CLI) stops taking calls, waits up to ``shutdown_grace_s`` for the
coordinators to acknowledge what finished, abandons the rest and ends `run` with 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random

from hexgen_flow.calibration import DEFAULT_CALIBRATION
from hexgen_service.auth import Role
from hexgen_service.eos_script import EosScript
from hexgen_service.metrics_server import MetricsProtection, serve_metrics
from hexgen_service.telemetry import setup_tracing
from hexgen_worker.config import WorkerConfig
from hexgen_worker.engines import Engine, create_engine
from hexgen_worker.events import CallReport
from hexgen_worker.link import EXIT_OK, EXIT_REJECTED, CoordinatorLink, CoordinatorRejectedError
from hexgen_worker.metrics import WorkerMetrics
from hexgen_worker.state import WorkerState

__all__ = ["EXIT_OK", "EXIT_REJECTED", "CoordinatorRejectedError", "Worker"]

log = logging.getLogger(__name__)


class Worker:
    """One serving instance linked to one or more coordinators; see the module docstring."""

    def __init__(self, config: WorkerConfig, *, engine: Engine | None = None) -> None:
        self.config = config.resolved()
        self.engine = engine
        """The engine (built from the config by `run` when not given; not started)."""
        self.state: WorkerState | None = None
        """The worker's calls and queue (set once `run` has started the engine)."""
        seed = self.config.jitter_seed
        self.links = [
            CoordinatorLink(
                index,
                address,
                self.config,
                rng=random.Random(seed if seed is None or index == 0 else seed + index),
                on_change=self._links_changed,
            )
            for index, address in enumerate(self.config.coordinators)
        ]
        """One link per coordinator, in ``--coordinator`` order."""
        self.welcomed = asyncio.Event()
        """Set while every link is welcomed."""
        self._stopping = asyncio.Event()

    @property
    def slot(self) -> int:
        """The slot the first coordinator gave (or the configured one before)."""
        return self.links[0].slot

    @property
    def welcomes(self) -> int:
        """Welcomes received so far, over every link (one per successful connection)."""
        return sum(link.welcomes for link in self.links)

    def stop(self) -> None:
        """Ask `run` to stop (safe to call from a signal handler on the loop)."""
        self._stopping.set()

    def _links_changed(self) -> None:
        if all(link.welcomed.is_set() for link in self.links):
            self.welcomed.set()
        else:
            self.welcomed.clear()

    def _send(self, link: int, report: CallReport) -> None:
        self.links[link].send(report)

    # ------------------------------------------------------------------ the process

    async def run(self) -> int:
        """Run until `stop()` or a rejection; return the process exit code (0 or 2)."""
        config = self.config
        tracer = setup_tracing("hexgen-worker")
        engine = self.engine if self.engine is not None else create_engine(config)
        self.engine = engine
        await engine.start()
        metrics = WorkerMetrics(config.worker_id, engine.kind) if config.metrics_listen else None
        state = WorkerState(
            engine,
            gpu=config.gpu,
            model=config.model,
            calibration=config.calibration,
            catalogue=config.catalogue,
            kv_cache_tokens=config.kv_cache_tokens or 0,
            send=self._send,
            coordinators=config.coordinators,
            tracer=tracer,
            metrics=metrics,
            eos_script=None if config.eos_script is None else EosScript.read(config.eos_script),
        )
        self.state = state
        metrics_server = None
        if metrics is not None:

            def load() -> tuple[int, int, int, int]:
                engine_load = engine.load()
                return (
                    engine_load.running,
                    state.queued(),
                    engine_load.kv_used_tokens,
                    config.kv_cache_tokens or 0,
                )

            metrics.watch(load)
            protection = MetricsProtection.of(
                config.metrics_tls_cert,
                config.metrics_tls_key,
                config.api_keys_file,
                Role.TENANT,  # any key: a worker's metrics name no tenant
            )
            address, metrics_server = serve_metrics(
                metrics.registry, config.metrics_listen, protection
            )
            log.info(
                "metrics on %s://%s/metrics%s",
                protection.scheme,
                address,
                " (an API key)" if protection.keys else "",
            )
        events = asyncio.create_task(state.run_engine_events(), name="engine-events")
        log.info(
            "worker %s: %s on %s, %s engine, calibration %s; coordinator %s",
            config.worker_id,
            config.model,
            config.gpu,
            engine.kind,
            config.calibration or DEFAULT_CALIBRATION,
            ", ".join(config.coordinators),
        )
        try:
            return await self._serve(state)
        finally:
            state.accepting = False
            events.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await events
            await engine.close()
            state.close()
            if metrics_server is not None:
                metrics_server.shutdown()
            log.info("worker %s stopped", config.worker_id)

    async def _serve(self, state: WorkerState) -> int:
        """Run every link until `stop()` (then drain) or until one is rejected."""
        links = [
            asyncio.create_task(link.run(state), name=f"coordinator-link-{link.index}")
            for link in self.links
        ]
        stopping = asyncio.create_task(self._stopping.wait())
        try:
            done, _ = await asyncio.wait({*links, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if stopping in done:
                await self._drain(state)
                return EXIT_OK
            # A link ends only when its coordinator rejected the worker (or its welcome
            # cannot be served): the whole worker stops, as with one coordinator.
            return max(task.result() for task in done if task is not stopping)
        finally:
            stopping.cancel()
            for task in links:
                task.cancel()
            await asyncio.gather(stopping, *links, return_exceptions=True)

    async def _drain(self, state: WorkerState) -> None:
        """Stopping: take no more calls; give the coordinators a moment to acknowledge what
        finished."""
        state.accepting = False
        welcomed = [link.index for link in self.links if link.welcomed.is_set()]
        if not welcomed:
            return

        def unacked() -> int:
            return sum(len(state.unacked(link)) for link in welcomed)

        loop = asyncio.get_running_loop()
        end = loop.time() + self.config.shutdown_grace_s
        while unacked() and loop.time() < end:
            await asyncio.sleep(0.01)
        if unacked():
            log.warning("stopping with %d unacknowledged results", unacked())
