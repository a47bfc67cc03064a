"""A coordinator and its simulated workers in this test's own process: a real gRPC server
on a free port, real Redis (under a fresh key prefix, removed at the end), real `Worker`
objects with the simulated engine. For tests that look inside the coordinator (its
objects, the spans it makes) while it serves over the wire."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import grpc
import redis.asyncio as aioredis

from hexgen_api.v1 import coordinator_pb2_grpc, worker_pb2_grpc
from hexgen_coordinator.config import CoordinatorConfig
from hexgen_coordinator.coordinator import Coordinator
from hexgen_coordinator.service import CoordinatorServicer, WorkerServicer
from hexgen_launch.processes import free_port
from hexgen_service.server import GrpcServer
from hexgen_worker import Worker, WorkerConfig
from redis_here import REDIS_URL

__all__ = ["drop_keys", "in_process_mesh", "serving"]


@asynccontextmanager
async def in_process_mesh(
    gpus: Sequence[str], name: str, **config: Any
) -> AsyncIterator[tuple[Coordinator, str]]:
    """(the coordinator, its address), one worker per GPU of `gpus` connected; `config`:
    more `CoordinatorConfig` fields (e.g. time_scale, admission)."""
    prefix = f"hf-{name}-{uuid.uuid4().hex[:8]}:"
    try:
        async with serving(gpus, prefix, **config) as (coordinator, address):
            yield coordinator, address
    finally:
        await drop_keys(prefix)


@asynccontextmanager
async def serving(
    gpus: Sequence[str], prefix: str, *, workers: bool = True, **config: Any
) -> AsyncIterator[tuple[Coordinator, str]]:
    """A coordinator on Redis key prefix `prefix` (what an earlier one there left, it
    resumes), serving on a free port, with one worker per GPU of `gpus` connected unless
    `workers` is false; stopped (gracefully) at the end, its keys left in Redis."""
    redis: aioredis.Redis[bytes] = aioredis.Redis.from_url(REDIS_URL)
    address = f"127.0.0.1:{free_port()}"
    coordinator = Coordinator(
        CoordinatorConfig(listen=address, redis_prefix=prefix, cluster=",".join(gpus), **config),
        redis,
    )
    await coordinator.start()

    def register(server: grpc.aio.Server) -> None:
        coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(
            CoordinatorServicer(coordinator), server
        )
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(WorkerServicer(coordinator), server)

    server = GrpcServer(address, register, ["hexgen_flow.v1.CoordinatorService"], grace_s=0.2)
    await server.start()
    running = [
        Worker(
            WorkerConfig(
                coordinator=address, worker_id=f"{prefix.rstrip(':')}-{slot}", slot=slot, gpu=gpu
            )
        )
        for slot, gpu in enumerate(gpus)
        if workers
    ]
    tasks = [asyncio.create_task(w.run()) for w in running]
    try:
        for w in running:
            await asyncio.wait_for(w.welcomed.wait(), 20)
        yield coordinator, address
    finally:
        for w in running:
            w.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
        await coordinator.stop()
        await server.stop()
        await redis.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose


async def drop_keys(prefix: str) -> None:
    """Delete every Redis key under `prefix`."""
    redis: aioredis.Redis[bytes] = aioredis.Redis.from_url(REDIS_URL)
    keys = [k async for k in redis.scan_iter(match=f"{prefix}*")]
    if keys:
        await redis.delete(*keys)
    await redis.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose
