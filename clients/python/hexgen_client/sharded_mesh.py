"""`LocalShardedMesh`: coordinator shards, spares and shared simulated workers on one machine.

What a sharded deployment runs, as local processes on one Redis: `shards` coordinators, each
given the same ``--shards hf:{s0}:,hf:{s1}:,...`` list and its own shard as
``--redis-prefix``, `spares` more that wait to take over a shard whose coordinator dies
(``hexgen_coordinator.shards``), and one simulated worker per slot of `cluster` linked to
every coordinator's workers' door (a spare's door opens once it holds a shard). Clients
reach any coordinator: each redirects what is not its own (`CoordinatorClient` with every
address in `client_addresses` follows the redirects). Plaintext on loopback, no keys: the
mesh of the tests and benchmarks of sharding (tests/test_coordinator_shards.py,
benchmarks/shard_takeover.py).
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import redis

from hexgen_client.processes import ManagedProcess, free_port, stop_processes
from hexgen_flow.cluster import parse_cluster
from hexgen_flow.errors import ConfigError

__all__ = ["CoordinatorProcess", "LocalShardedMesh", "ShardedMeshConfig"]


@dataclass(frozen=True, slots=True)
class ShardedMeshConfig:
    redis_url: str
    """The Redis every coordinator keeps its shard in."""
    logs: Path
    """Where each process writes its log."""
    shards: int = 2
    spares: int = 1
    cluster: str = "A100,A100,A6000,L40S"
    calibration: str | None = None
    """The latency numbers' source, the coordinators' and the workers' (None: default)."""
    time_scale: float = 20.0
    lease_ttl_s: float = 2.0
    resume_grace_s: float = 1.0
    extra_coordinator_args: tuple[str, ...] = ("--admission", "off")
    start_timeout_s: float = 45.0
    tuner: bool = False
    """Run one α tuner for every shard (``--shards``: all shards' traffic, α to every
    coordinator), its own records under ``hf:tuner:``."""
    tuner_period_s: float = 30.0
    gateway: bool = False
    """Run the OpenAI-compatible gateway, given every coordinator's address."""

    def __post_init__(self) -> None:
        if self.shards < 1 or self.spares < 0:
            raise ConfigError("a sharded mesh needs shards >= 1 and spares >= 0")

    @property
    def prefixes(self) -> tuple[str, ...]:
        return tuple(f"hf:{{s{k}}}:" for k in range(self.shards))


@dataclass
class CoordinatorProcess:
    name: str
    listen: str
    """Its clients' door (and the address its lease publishes)."""
    worker_door: str
    process: ManagedProcess


@dataclass
class LocalShardedMesh:
    config: ShardedMeshConfig
    coordinators: list[CoordinatorProcess] = field(default_factory=list)
    workers: list[ManagedProcess] = field(default_factory=list)
    services: list[ManagedProcess] = field(default_factory=list)
    """The tuner and the gateway, when asked for."""
    tuner_address: str = ""
    gateway_address: str = ""

    @property
    def client_addresses(self) -> str:
        """Every coordinator's clients' door, comma-separated (what a client is given)."""
        return ",".join(c.listen for c in self.coordinators)

    def start(self) -> LocalShardedMesh:
        cfg = self.config
        cfg.logs.mkdir(parents=True, exist_ok=True)
        prefixes = cfg.prefixes
        # Shards first, so that each takes its own prefix before a spare could.
        for k in range(cfg.shards + cfg.spares):
            self.coordinators.append(self._coordinator(k, prefixes))
            if k == cfg.shards - 1:
                self._wait_leases(prefixes)
        doors = [arg for c in self.coordinators for arg in ("--coordinator", c.worker_door)]
        for slot, instance in enumerate(parse_cluster(cfg.cluster).instances):
            argv = [
                sys.executable, "-m", "hexgen_worker",
                *doors,
                "--worker-id", f"worker-{slot}",
                "--slot", str(slot),
                "--gpu", instance.gpu,
                "--log-level", "WARNING",
                *(["--calibration", cfg.calibration] if cfg.calibration else []),
            ]  # fmt: skip
            worker = ManagedProcess(f"worker {slot}", argv, cfg.logs / f"worker-{slot}.log")
            worker.start()
            self.workers.append(worker)
        if cfg.tuner:
            self.tuner_address = f"127.0.0.1:{free_port()}"
            argv = [
                sys.executable, "-m", "hexgen_tuner",
                "--listen", self.tuner_address,
                "--coordinator", self.client_addresses,
                "--redis-url", cfg.redis_url,
                "--shards", ",".join(prefixes),
                "--redis-prefix", "hf:tuner:",
                "--period-s", repr(cfg.tuner_period_s),
            ]  # fmt: skip
            self._service("tuner", argv)
        if cfg.gateway:
            self.gateway_address = f"127.0.0.1:{free_port()}"
            argv = [
                sys.executable, "-m", "hexgen_gateway",
                "--listen", self.gateway_address,
                "--coordinator", self.client_addresses,
            ]  # fmt: skip
            self._service("gateway", argv)
        return self

    def _service(self, name: str, argv: list[str]) -> None:
        process = ManagedProcess(name, argv, self.config.logs / f"{name}.log")
        process.start()
        self.services.append(process)

    def exited(self) -> list[ManagedProcess]:
        """The processes that are no longer running (a killed coordinator among them)."""
        every = [*(c.process for c in self.coordinators), *self.workers, *self.services]
        return [p for p in every if not p.running]

    def holders(self) -> list[str | None]:
        """Each shard's lease holder (its coordinator's client address), None if none."""
        client = redis.Redis.from_url(self.config.redis_url)
        try:
            values = [client.get(p + "lease") for p in self.config.prefixes]
        finally:
            client.close()
        return [v.decode() if v is not None else None for v in values]

    def completed_calls(self) -> Counter[str]:
        """How often each call id is in its shard's ``completions`` stream, over every shard
        (one entry per completion the shard applied: each call once, when none is lost and
        none is applied twice)."""
        client = redis.Redis.from_url(self.config.redis_url)
        done: Counter[str] = Counter()
        try:
            for prefix in self.config.prefixes:
                entries = client.xrange(prefix + "completions")
                done.update(fields[b"call_id"].decode() for _, fields in entries)
        finally:
            client.close()
        return done

    def kill_shard(self, shard: int, timeout_s: float = 60.0) -> float:
        """SIGKILL the coordinator holding `shard`; wall seconds until another holds it
        (`TimeoutError` after `timeout_s`)."""
        victim = self.coordinator_at(str(self.holders()[shard]))
        victim.process.kill()
        killed = time.monotonic()
        while self.holders()[shard] in (None, victim.listen):
            if time.monotonic() - killed > timeout_s:
                raise TimeoutError(f"no coordinator took shard {shard} over in {timeout_s:g} s")
            time.sleep(0.05)
        return time.monotonic() - killed

    def coordinator_at(self, address: str) -> CoordinatorProcess:
        return next(c for c in self.coordinators if c.listen == address)

    def stop(self) -> None:
        stop_processes(
            [*self.services, *self.workers, *(c.process for c in self.coordinators)], grace_s=5.0
        )

    def __enter__(self) -> LocalShardedMesh:
        try:
            return self.start()
        except BaseException:
            self.stop()  # what did start is not left running
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _coordinator(self, k: int, prefixes: tuple[str, ...]) -> CoordinatorProcess:
        cfg = self.config
        name = f"s{k}" if k < cfg.shards else f"spare{k - cfg.shards}"
        listen, door = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        # A spare names no shard of its own: it takes whichever lease expires first.
        prefix = prefixes[k] if k < cfg.shards else "hf:spare:"
        argv = [
            sys.executable, "-m", "hexgen_coordinator",
            "--listen", listen,
            "--worker-listen", door,
            "--redis-url", cfg.redis_url,
            "--shards", ",".join(prefixes),
            "--redis-prefix", prefix,
            "--lease-ttl-s", repr(cfg.lease_ttl_s),
            "--resume-grace-s", repr(cfg.resume_grace_s),
            "--cluster", cfg.cluster,
            "--time-scale", repr(cfg.time_scale),
            "--log-level", "INFO",
            *cfg.extra_coordinator_args,
        ]  # fmt: skip
        process = ManagedProcess(f"coordinator {name}", argv, cfg.logs / f"coordinator-{name}.log")
        process.start()
        return CoordinatorProcess(name, listen, door, process)

    def _wait_leases(self, prefixes: tuple[str, ...]) -> None:
        """Until every shard's lease names the coordinator started for it."""
        wanted = [c.listen for c in self.coordinators[: len(prefixes)]]
        deadline = time.monotonic() + self.config.start_timeout_s
        while self.holders() != wanted:
            for c in self.coordinators:
                if not c.process.running:
                    raise c.process.failure("exited")
            if time.monotonic() > deadline:
                raise TimeoutError(f"shard leases {self.holders()}, expected {wanted}")
            time.sleep(0.1)
