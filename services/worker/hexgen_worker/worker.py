"""The worker process: its engine, its `WorkerState`, and the link to the coordinator.

`Worker(config).run()` starts the engine, then keeps one bidirectional
``WorkerService.Connect`` stream open to the coordinator for as long as it runs:

1. send ``hello`` (worker id, slot, GPU, model, engine, capacity, resident and unacked
   call ids), then every unacknowledged ``finished`` message again;
2. wait for ``welcome`` and configure the state from it (clock, local queue, drops);
3. serve: dispatch / cancel / deadline / ack messages go to the state, the engine's
   events and a heartbeat every interval go back.

When the stream breaks the engine keeps running and the worker reconnects with jittered
exponential backoff (0.1 s doubling to 2 s by default) and a fresh hello. A hello the
coordinator rejects with INVALID_ARGUMENT or FAILED_PRECONDITION ends `run` with exit code
2; `stop()` (SIGTERM/SIGINT in the CLI) stops taking calls, waits up to
``shutdown_grace_s`` for the coordinator to acknowledge what finished, abandons the rest
and ends `run` with 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random

import grpc

from hexgen_api.v1 import worker_pb2, worker_pb2_grpc
from hexgen_flow.calibration import DEFAULT_CALIBRATION
from hexgen_flow.errors import ConfigError, WorkloadError
from hexgen_service.convert import dispatch_to_ticket
from hexgen_service.errors import InvalidFieldError
from hexgen_service.metrics_server import serve_metrics
from hexgen_service.telemetry import client_interceptors, setup_tracing
from hexgen_service.tls import TlsFiles, channel_credentials
from hexgen_service.worker_token import TOKEN_METADATA
from hexgen_worker.config import WorkerConfig
from hexgen_worker.convert import (
    dispatch_messages,
    event_request,
    heartbeat_request,
    hello_request,
    welcome_from_proto,
)
from hexgen_worker.engines import Engine, create_engine
from hexgen_worker.events import CallReport
from hexgen_worker.metrics import WorkerMetrics
from hexgen_worker.state import WorkerState

__all__ = ["EXIT_OK", "EXIT_REJECTED", "CoordinatorRejectedError", "Worker"]

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_REJECTED = 2
"""The coordinator refused this worker, or the worker's settings are wrong."""

_FATAL_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNAUTHENTICATED,  # a token the coordinator refuses stays refused
    }
)

_Outgoing = asyncio.Queue[worker_pb2.ConnectRequest]


class CoordinatorRejectedError(Exception):
    """The coordinator aborted the stream before the welcome with a status that retrying
    cannot change."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        self.details = details
        super().__init__(f"{code.name}: {details}")


class _LinkLostError(Exception):
    """The stream ended or no welcome came: reconnect."""


class Worker:
    """One serving instance linked to a coordinator; see the module docstring."""

    def __init__(self, config: WorkerConfig, *, engine: Engine | None = None) -> None:
        self.config = config.resolved()
        self.engine = engine
        """The engine (built from the config by `run` when not given; not started)."""
        self.state: WorkerState | None = None
        """The worker's calls and queue (set once `run` has started the engine)."""
        self.slot = self.config.slot
        """The slot this worker asks for: the configured one, then the one it was given."""
        self.welcomes = 0
        """Welcomes received so far (one per successful connection)."""
        self.welcomed = asyncio.Event()
        """Set while a welcomed connection is up."""
        self._stopping = asyncio.Event()
        self._rng = random.Random(self.config.jitter_seed)
        self._outgoing: _Outgoing | None = None

    def stop(self) -> None:
        """Ask `run` to stop (safe to call from a signal handler on the loop)."""
        self._stopping.set()

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
            kv_cache_tokens=config.kv_cache_tokens or 0,
            send=self._send,
            tracer=tracer,
            metrics=metrics,
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
            address, metrics_server = serve_metrics(metrics.registry, config.metrics_listen)
            log.info("metrics on http://%s/metrics", address)
        events = asyncio.create_task(state.run_engine_events(), name="engine-events")
        log.info(
            "worker %s: %s on %s, %s engine, calibration %s; coordinator %s",
            config.worker_id,
            config.model,
            config.gpu,
            engine.kind,
            config.calibration or DEFAULT_CALIBRATION,
            config.coordinator,
        )
        try:
            return await self._link(state)
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

    async def _link(self, state: WorkerState) -> int:
        config = self.config
        delay = config.backoff_initial_s
        while not self._stopping.is_set():
            welcomes = self.welcomes
            session = asyncio.create_task(self._session(state), name="coordinator-link")
            stopping = asyncio.create_task(self._stopping.wait())
            await asyncio.wait({session, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not session.done():
                await self._drain(state)
                session.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await session
                break
            stopping.cancel()
            try:
                session.result()
                log.warning("coordinator %s closed the stream; reconnecting", config.coordinator)
            except CoordinatorRejectedError as exc:
                log.error(
                    "coordinator %s rejected worker %s: %s",
                    config.coordinator,
                    config.worker_id,
                    exc,
                )
                return EXIT_REJECTED
            except (ConfigError, InvalidFieldError) as exc:
                log.error("cannot serve the coordinator's welcome: %s", exc)
                return EXIT_REJECTED
            except grpc.aio.AioRpcError as exc:
                log.warning(
                    "link to coordinator %s lost: %s %s",
                    config.coordinator,
                    exc.code().name,
                    exc.details(),
                )
            except _LinkLostError as exc:
                log.warning("link to coordinator %s lost: %s", config.coordinator, exc)
            except Exception:
                log.exception("link to coordinator %s failed; reconnecting", config.coordinator)
            if self.welcomes > welcomes:
                delay = config.backoff_initial_s  # that connection worked: start over
            wait = delay * (0.5 + 0.5 * self._rng.random())
            delay = min(delay * 2, config.backoff_max_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), wait)
        return EXIT_OK

    async def _drain(self, state: WorkerState) -> None:
        """Stopping: take no more calls; give the coordinator a moment to acknowledge what
        finished."""
        state.accepting = False
        if not self.welcomed.is_set():
            return
        loop = asyncio.get_running_loop()
        end = loop.time() + self.config.shutdown_grace_s
        while state.unacked() and loop.time() < end:
            await asyncio.sleep(0.01)
        if state.unacked():
            log.warning("stopping with %d unacknowledged results", len(state.unacked()))

    # ------------------------------------------------------------------ one connection

    def _send(self, event: CallReport) -> None:
        out = self._outgoing
        if out is not None:
            out.put_nowait(event_request(event))
        # else: disconnected; a CallFinished waits in the state's outbox for the next hello

    async def _session(self, state: WorkerState) -> None:
        config = self.config
        options = [
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            # A subchannel of our own: gRPC's shared one keeps its own reconnect backoff
            # (1 s growing to 120 s) across channels, which would hold a reconnect back
            # long after the coordinator is up again; our backoff decides instead.
            ("grpc.use_local_subchannel_pool", 1),
        ]
        tls = TlsFiles.from_flags(
            config.tls_cert or None, config.tls_key or None, config.tls_ca or None
        )
        channel = (
            grpc.aio.secure_channel(
                config.coordinator,
                channel_credentials(tls),
                interceptors=client_interceptors(),
                options=options,
            )
            if tls.enabled
            else grpc.aio.insecure_channel(
                config.coordinator, interceptors=client_interceptors(), options=options
            )
        )
        tasks: list[asyncio.Task[None]] = []
        call = None
        try:
            metadata = ((TOKEN_METADATA, config.worker_token),) if config.worker_token else None
            call = worker_pb2_grpc.WorkerServiceStub(channel).Connect(metadata=metadata)
            out: _Outgoing = asyncio.Queue()
            unacked = state.unacked()
            out.put_nowait(
                hello_request(
                    config,
                    slot=self.slot,
                    resident_call_ids=state.resident_call_ids(),
                    unacked_call_ids=[f.call_id for f in unacked],
                )
            )
            for finished in unacked:
                out.put_nowait(event_request(finished))
            self._outgoing = out  # from here on the state's reports go on this stream
            writer = asyncio.create_task(self._write(call, out), name="link-writer")
            tasks.append(writer)
            welcome = await self._welcome(call, writer)
            settings = welcome_from_proto(welcome)
            state.configure(settings)
            self.slot = settings.slot
            self.welcomes += 1
            self.welcomed.set()
            log.info(
                "welcomed by %s as %s (slot %d), time scale %g, %s queue, %d resident, %d "
                "unacknowledged",
                config.coordinator,
                settings.instance,
                settings.slot,
                settings.clock.time_scale,
                settings.queue_policy,
                len(state.resident_call_ids()),
                len(unacked),
            )
            tasks.append(
                asyncio.create_task(
                    self._heartbeats(state, out, settings.heartbeat_interval_s), name="heartbeat"
                )
            )
            reader = asyncio.create_task(self._read(call, state), name="link-reader")
            tasks.append(reader)
            done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # raises the stream's error
        finally:
            self._outgoing = None
            self.welcomed.clear()
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            if call is not None:
                call.cancel()
            await channel.close(grace=None)

    async def _welcome(
        self,
        call: grpc.aio.StreamStreamCall[worker_pb2.ConnectRequest, worker_pb2.ConnectResponse],
        writer: asyncio.Task[None],
    ) -> worker_pb2.WorkerWelcome:
        read = asyncio.ensure_future(call.read())
        try:
            done, _ = await asyncio.wait(
                {read, writer},
                timeout=self.config.welcome_timeout_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if not done:
                raise _LinkLostError(f"no welcome within {self.config.welcome_timeout_s:g} s")
            if read in done:
                message = read.result()
            else:
                writer.result()
                raise _LinkLostError("the stream ended before the welcome")
        except Exception as exc:
            # The rejection's status is on the call, whichever half noticed the end first.
            if isinstance(exc, grpc.aio.AioRpcError):
                code, details = exc.code(), exc.details() or ""
            elif call.done():
                code, details = await call.code(), await call.details()
            else:
                raise
            if code in _FATAL_CODES:
                raise CoordinatorRejectedError(code, details) from None
            raise
        finally:
            read.cancel()
        if not isinstance(message, worker_pb2.ConnectResponse):
            raise _LinkLostError("the coordinator closed the stream before the welcome")
        if message.WhichOneof("message") != "welcome":
            raise _LinkLostError(f"expected a welcome first, got {message.WhichOneof('message')!r}")
        return message.welcome

    @staticmethod
    async def _write(
        call: grpc.aio.StreamStreamCall[worker_pb2.ConnectRequest, worker_pb2.ConnectResponse],
        out: _Outgoing,
    ) -> None:
        while True:
            await call.write(await out.get())

    async def _read(
        self,
        call: grpc.aio.StreamStreamCall[worker_pb2.ConnectRequest, worker_pb2.ConnectResponse],
        state: WorkerState,
    ) -> None:
        while True:
            message = await call.read()
            if not isinstance(message, worker_pb2.ConnectResponse):
                return  # end of stream
            self._handle(message, state)

    def _handle(self, message: worker_pb2.ConnectResponse, state: WorkerState) -> None:
        kind = message.WhichOneof("message")
        if kind == "dispatch":
            pb = message.dispatch
            try:
                ticket = dispatch_to_ticket(pb)
            except (WorkloadError, ValueError) as exc:
                state.fail(pb.call_id, f"invalid dispatch: {exc}", attempt=pb.attempt)
                return
            state.dispatch(
                ticket,
                prompt=pb.prompt,
                messages=dispatch_messages(pb),
                traceparent=pb.traceparent,
            )
        elif kind == "cancel":
            state.cancel(message.cancel.call_id)
        elif kind == "deadline":
            state.update_deadline(message.deadline.call_id, message.deadline.deadline_s)
        elif kind == "ack":
            state.ack(message.ack.call_ids)
        elif kind == "welcome":
            state.configure(welcome_from_proto(message.welcome))
        else:
            log.debug("ignoring an empty or unknown message from the coordinator")

    async def _heartbeats(self, state: WorkerState, out: _Outgoing, interval_s: float) -> None:
        while True:
            out.put_nowait(heartbeat_request(state.heartbeat()))
            await asyncio.sleep(interval_s)
