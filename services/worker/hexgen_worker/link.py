"""One coordinator's link at the worker: its stream, welcome, reconnects and heartbeats.

A worker keeps one `CoordinatorLink` per coordinator it serves (``--coordinator``, repeated
for coordinator shards), all feeding the worker's one `WorkerState`. A link keeps one
bidirectional ``WorkerService.Connect`` stream open to its coordinator:

1. send ``hello`` (worker id, slot, GPU, model, engine, capacity, and the link's own
   resident and unacked call ids), then every unacknowledged ``finished`` message of the
   link again;
2. wait for ``welcome`` and configure the state from it (clock, local queue, drops);
3. serve: dispatch / cancel / deadline / ack messages go to the state as this link's, the
   reports of this link's calls and a heartbeat every interval go back.

When the stream breaks the engine keeps running and the link reconnects with jittered
exponential backoff (0.1 s doubling to 2 s by default) and a fresh hello; the other links
are not disturbed. A welcome naming the coordinator shard that a lost link served moves that
link's calls here (`hexgen_worker.handover`); the link then reopens its stream at once, so
that its hello lists them. A hello the coordinator rejects with INVALID_ARGUMENT,
FAILED_PRECONDITION or UNAUTHENTICATED, or a welcome the worker cannot serve (one that
disagrees with another link's, `hexgen_worker.shards`), ends the link with exit code 2.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator, Callable

import grpc

from hexgen_api.v1 import worker_pb2, worker_pb2_grpc
from hexgen_flow.errors import ConfigError, WorkloadError
from hexgen_service.convert import dispatch_to_ticket
from hexgen_service.errors import InvalidFieldError
from hexgen_service.telemetry import client_interceptors
from hexgen_service.tls import TlsFiles, channel_credentials
from hexgen_service.worker_token import TOKEN_METADATA
from hexgen_worker.config import WorkerConfig
from hexgen_worker.convert import (
    dispatch_messages,
    dispatch_options,
    event_request,
    heartbeat_request,
    hello_request,
    welcome_from_proto,
)
from hexgen_worker.events import CallReport
from hexgen_worker.handover import hand_over_shard
from hexgen_worker.state import WorkerState

__all__ = ["EXIT_OK", "EXIT_REJECTED", "CoordinatorLink", "CoordinatorRejectedError"]

log = logging.getLogger("hexgen_worker.worker")  # the worker's one logger

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

_Outgoing = asyncio.Queue[worker_pb2.ConnectRequest | None]
"""A connection's outgoing messages; None ends its request stream."""
_Call = grpc.aio.StreamStreamCall[worker_pb2.ConnectRequest, worker_pb2.ConnectResponse]


class CoordinatorRejectedError(Exception):
    """The coordinator aborted the stream before the welcome with a status that retrying
    cannot change."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        self.details = details
        super().__init__(f"{code.name}: {details}")


class _LinkLostError(Exception):
    """The stream ended or no welcome came: reconnect."""


class _HandedOverError(Exception):
    """Calls were handed over to this link after its hello: say hello again, at once."""


async def _requests(out: _Outgoing) -> AsyncIterator[worker_pb2.ConnectRequest]:
    """A connection's request stream: what is put in `out`, until None."""
    while (message := await out.get()) is not None:
        yield message


class CoordinatorLink:
    """Link `index` of a worker, to the coordinator at `address`; see the module docstring.
    `on_change` is called whenever the link is welcomed or lost."""

    def __init__(
        self,
        index: int,
        address: str,
        config: WorkerConfig,
        *,
        rng: random.Random,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.index = index
        self.address = address
        self.config = config
        self.slot = config.slot
        """The slot this link asks for: the configured one, then the one it was given."""
        self.welcomes = 0
        """Welcomes received so far (one per successful connection)."""
        self.welcomed = asyncio.Event()
        """Set while a welcomed connection is up."""
        self._rng = rng
        self._on_change = on_change
        self._outgoing: _Outgoing | None = None

    def send(self, report: CallReport) -> None:
        """Send a report of one of this link's calls (dropped while disconnected: a
        CallFinished waits in the state's outbox for the next hello)."""
        out = self._outgoing
        if out is not None:
            out.put_nowait(event_request(report))

    async def run(self, state: WorkerState) -> int:
        """Keep the link up until cancelled; returns only on a rejection (EXIT_REJECTED)."""
        config = self.config
        delay = config.backoff_initial_s
        while True:
            welcomes = self.welcomes
            try:
                await self._session(state)
                log.warning("coordinator %s closed the stream; reconnecting", self.address)
            except _HandedOverError:
                delay = config.backoff_initial_s
                continue
            except CoordinatorRejectedError as exc:
                log.error(
                    "coordinator %s rejected worker %s: %s", self.address, config.worker_id, exc
                )
                return EXIT_REJECTED
            except (ConfigError, InvalidFieldError) as exc:
                log.error("cannot serve the welcome of coordinator %s: %s", self.address, exc)
                return EXIT_REJECTED
            except grpc.aio.AioRpcError as exc:
                log.warning(
                    "link to coordinator %s lost: %s %s",
                    self.address,
                    exc.code().name,
                    exc.details(),
                )
            except _LinkLostError as exc:
                log.warning("link to coordinator %s lost: %s", self.address, exc)
            except Exception:
                log.exception("link to coordinator %s failed; reconnecting", self.address)
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                # The worker is stopping: a cancellation that reached us as the stream's
                # error (gRPC reports a cancelled read as CANCELLED) must still end the link.
                raise asyncio.CancelledError
            if self.welcomes > welcomes:
                delay = config.backoff_initial_s  # that connection worked: start over
            wait = delay * (0.5 + 0.5 * self._rng.random())
            delay = min(delay * 2, config.backoff_max_s)
            await asyncio.sleep(wait)

    # ------------------------------------------------------------------ one connection

    def _channel(self) -> grpc.aio.Channel:
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
        if tls.enabled:
            return grpc.aio.secure_channel(
                self.address,
                channel_credentials(tls),
                interceptors=client_interceptors(),
                options=options,
            )
        return grpc.aio.insecure_channel(
            self.address, interceptors=client_interceptors(), options=options
        )

    async def _session(self, state: WorkerState) -> None:
        config = self.config
        link = self.index
        channel = self._channel()
        tasks: list[asyncio.Task[None]] = []
        call = None
        out: _Outgoing = asyncio.Queue()
        try:
            metadata = ((TOKEN_METADATA, config.worker_token),) if config.worker_token else None
            # The requests are an iterator of ours, not `call.write`: when the coordinator
            # goes away, a write raced the stream's end (InvalidStateError "RPC already
            # finished", an ERROR with a traceback for an expected event), and gRPC's
            # request task of a call its peer ended was never finished (asyncio's "Task was
            # destroyed but it is pending!"). The None put in `finally` ends the iterator,
            # and with it that task; the stream's end is read from the call alone.
            call = worker_pb2_grpc.WorkerServiceStub(channel).Connect(
                _requests(out), metadata=metadata
            )
            unacked = state.unacked(link)
            out.put_nowait(
                hello_request(
                    config,
                    slot=self.slot,
                    resident_call_ids=state.resident_call_ids(link),
                    unacked_call_ids=[f.call_id for f in unacked],
                )
            )
            for finished in unacked:
                out.put_nowait(event_request(finished))
            self._outgoing = out  # from here on this link's reports go on this stream
            welcome = await self._welcome(call)
            settings = welcome_from_proto(welcome)
            state.configure(settings, link)
            self.slot = settings.slot
            if hand_over_shard(state, link):
                # This coordinator welcomed a hello without them; nothing else was read.
                raise _HandedOverError
            self.welcomes += 1
            self.welcomed.set()
            state.shards.up[link] = True
            self._on_change()
            log.info(
                "welcomed by %s as %s (slot %d), time scale %g, %s queue, %d resident, %d "
                "unacknowledged",
                self.address,
                settings.instance,
                settings.slot,
                settings.clock.time_scale,
                settings.queue_policy,
                len(state.resident_call_ids(link)),
                len(unacked),
            )
            tasks.append(
                asyncio.create_task(
                    self._heartbeats(state, out, settings.heartbeat_interval_s), name="heartbeat"
                )
            )
            await self._read(call, state)  # until the stream ends; raises its error
        finally:
            self._outgoing = None
            out.put_nowait(None)  # ends the request iterator, and gRPC's task that reads it
            state.shards.up[link] = False
            if self.welcomed.is_set():
                self.welcomed.clear()
                self._on_change()
            for task in tasks:
                task.cancel()
            # Their own ends (cancelled, or the stream's error) are returned, not raised; a
            # cancellation of this link itself while it waits here still propagates (a
            # suppress(CancelledError) around each await would swallow it, and a stopping
            # worker would wait for this link for ever).
            await asyncio.gather(*tasks, return_exceptions=True)
            if call is not None:
                call.cancel()
            await channel.close(grace=None)

    async def _welcome(self, call: _Call) -> worker_pb2.WorkerWelcome:
        read = asyncio.ensure_future(call.read())
        try:
            done, _ = await asyncio.wait({read}, timeout=self.config.welcome_timeout_s)
            if not done:
                raise _LinkLostError(f"no welcome within {self.config.welcome_timeout_s:g} s")
            message = read.result()
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _FATAL_CODES:
                raise CoordinatorRejectedError(exc.code(), exc.details() or "") from None
            raise
        finally:
            read.cancel()
        if not isinstance(message, worker_pb2.ConnectResponse):
            raise _LinkLostError("the coordinator closed the stream before the welcome")
        if message.WhichOneof("message") != "welcome":
            raise _LinkLostError(f"expected a welcome first, got {message.WhichOneof('message')!r}")
        return message.welcome

    async def _read(self, call: _Call, state: WorkerState) -> None:
        while True:
            message = await call.read()
            if not isinstance(message, worker_pb2.ConnectResponse):
                return  # end of stream
            self._handle(message, state)

    def _handle(self, message: worker_pb2.ConnectResponse, state: WorkerState) -> None:
        link = self.index
        kind = message.WhichOneof("message")
        if kind == "dispatch":
            pb = message.dispatch
            try:
                ticket = dispatch_to_ticket(pb)
                options = dispatch_options(pb)
            except (WorkloadError, ValueError) as exc:
                state.fail(pb.call_id, f"invalid dispatch: {exc}", attempt=pb.attempt, link=link)
                return
            state.dispatch(
                ticket,
                link=link,
                prompt=pb.prompt,
                messages=dispatch_messages(pb),
                options=options,
                traceparent=pb.traceparent,
            )
        elif kind == "cancel":
            state.cancel(message.cancel.call_id, link=link)
        elif kind == "deadline":
            state.update_deadline(message.deadline.call_id, message.deadline.deadline_s, link=link)
        elif kind == "ack":
            state.ack(message.ack.call_ids, link=link)
        elif kind == "welcome":
            state.configure(welcome_from_proto(message.welcome), link)
        else:
            log.debug("ignoring an empty or unknown message from the coordinator")

    async def _heartbeats(self, state: WorkerState, out: _Outgoing, interval_s: float) -> None:
        while True:
            out.put_nowait(heartbeat_request(state.heartbeat(self.index)))
            await asyncio.sleep(interval_s)
