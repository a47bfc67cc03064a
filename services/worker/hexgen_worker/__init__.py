"""HexGen-Flow worker: one serving instance, its local queue in front of an engine,
linked to its coordinator (or to each of several coordinator shards) by one
``WorkerService.Connect`` stream.

Start one from code with ``await Worker(WorkerConfig(coordinator=..., worker_id=...,
gpu=...)).run()``; from a shell with ``python -m hexgen_worker``.
"""

from hexgen_worker.config import WorkerConfig
from hexgen_worker.state import DispatchOutcome, WelcomeSettings, WorkerState
from hexgen_worker.worker import Worker

__all__ = ["DispatchOutcome", "WelcomeSettings", "Worker", "WorkerConfig", "WorkerState"]
