"""`LocalShardedMesh`: coordinator shards, spares and shared simulated workers on one machine.

What a sharded deployment runs, as local processes on one Redis (a private one unless
given, or a node of a Redis Cluster): `shards` coordinators, each given the same
``--shards hf:{s0}:,hf:{s1}:,...`` list and its own shard as ``--redis-prefix``, `spares`
more that wait to take over a shard whose coordinator dies (``hexgen_coordinator.shards``),
and one simulated worker per slot of `cluster` linked to every coordinator's workers' door
(a spare's door opens once it holds a shard). Clients reach any coordinator: each redirects
what is not its own (`CoordinatorClient` with every address in `client_addresses` follows
the redirects). The mesh of ``hexgen-flow up --shards`` and of the tests and benchmarks of
sharding (tests/test_coordinator_shards.py, benchmarks/shard_takeover.py).

Open on loopback by default; given an auth directory (`ShardedMeshConfig.auth_dir`) it runs
secured as `LocalCluster` does, with the same options (`secure_settings`, `secure_argv`,
`redis_login`): API keys and TLS on every coordinator, the tuner and the gateway, workers
with a client certificate and the workers' token, and a private Redis whose ACL users (one
per service) are given every shard's keys, since a spare may take any shard over.

Every service's command line is rendered through its typed settings (the coordinators'
through `hexgen_service.coordinator_config.CoordinatorConfig`, as `up`'s is), and a
coordinator's, with its free-form `ShardedMeshConfig.extra_coordinator_args`, is parsed back
as the coordinator parses it before it starts (`parse_coordinator_argv`).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import NoReturn

import redis

from hexgen_client.addresses import DEFAULT_REDIS_PREFIX
from hexgen_flow.cluster import parse_cluster
from hexgen_flow.errors import ConfigError
from hexgen_launch.cluster_config import (
    DEFAULT_CLUSTER_PREFIX,
    SHARDED_ADMISSION,
    redis_login,
    secure_argv,
    secure_settings,
)
from hexgen_launch.processes import ManagedProcess, RedisServer, free_port, stop_processes
from hexgen_service import redis_schema
from hexgen_service.auth import read_secret
from hexgen_service.auth_dir import AuthDir
from hexgen_service.coordinator_config import CoordinatorConfig, add_coordinator_options
from hexgen_service.coordinator_config import coordinator_argv as render_coordinator_argv
from hexgen_service.gateway_config import GatewayConfig
from hexgen_service.gateway_config import gateway_argv as render_gateway_argv
from hexgen_service.settings import from_args
from hexgen_service.tls import add_tls_options
from hexgen_service.tuner_config import TunerConfig
from hexgen_service.tuner_config import tuner_argv as render_tuner_argv
from hexgen_service.worker_config import WorkerConfig, worker_argv

__all__ = [
    "SPARE_PREFIX",
    "CoordinatorProcess",
    "LocalShardedMesh",
    "ShardedMeshConfig",
    "parse_coordinator_argv",
]

SPARE_PREFIX = "hf:{spare}:"
"""A spare's ``--redis-prefix``: no shard's, so that it takes whichever lease expires first.
It writes no key under it (it serves a shard's prefix once it holds one); the hash tag is
there because on a Redis Cluster every coordinator's prefix must carry one."""

COORDINATOR_LOG_LEVEL = "INFO"
"""The coordinators' ``--log-level`` (each logs its lease and takeovers at INFO)."""


class _CheckingParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # raises rather than exits
        raise ConfigError(message)


def parse_coordinator_argv(argv: Sequence[str]) -> CoordinatorConfig:
    """The settings that the coordinator options `argv` (no interpreter, no module) give,
    parsed with the coordinator's own options (`add_coordinator_options` and the TLS ones)
    and checked as ``python -m hexgen_coordinator`` checks them (the secret files read):
    `ConfigError` with argparse's or the setting's message on a wrong option or value."""
    parser = _CheckingParser(prog="python -m hexgen_coordinator", add_help=False)
    add_coordinator_options(parser)
    add_tls_options(parser, serves="TLS (both doors)")
    return from_args(CoordinatorConfig, parser.parse_args(list(argv)))


@dataclass(frozen=True, slots=True)
class ShardedMeshConfig:
    redis_url: str
    """The Redis every coordinator keeps its shard in; empty: a private ``redis-server``
    (append-only file fsynced always), started and stopped with the mesh."""
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
    extra_coordinator_args: tuple[str, ...] = ("--admission", SHARDED_ADMISSION)
    """More coordinator options (`hexgen-flow up --shards`: `sharded_coordinator_args`)."""
    start_timeout_s: float = 45.0
    tuner: bool = False
    """Run one α tuner for every shard (``--shards``: all shards' traffic, α to every
    coordinator), its own records under `tuner_prefix`."""
    tuner_period_s: float = 30.0
    gateway: bool = False
    """Run the OpenAI-compatible gateway, given every coordinator's address."""
    redis_cluster: bool = False
    """`redis_url` is a node of a Redis Cluster (the coordinators' and the tuner's
    ``--redis-cluster``): each shard's prefix carries its own hash tag, so each shard's keys
    are in one slot and the shards spread over the masters."""
    auth_dir: Path | None = None
    """Run secured with the credentials of this folder, made or completed at `start` with a
    Redis ACL for every shard (`AuthDir.init` with ``shards``); the services log in to the
    private Redis as their ACL users. None: open, on loopback."""
    tenants: tuple[str, ...] = ()
    """With `auth_dir`: the tenants to make keys for (``DIR/tenants/NAME.key``)."""

    def __post_init__(self) -> None:
        if self.shards < 1 or self.spares < 0:
            raise ConfigError("a sharded mesh needs shards >= 1 and spares >= 0")
        if self.redis_cluster and not self.redis_url:
            raise ConfigError("--redis-cluster: give --redis-url, a node of the Redis Cluster")
        if self.tenants and self.auth_dir is None:
            raise ConfigError("--tenants goes with --secure (an auth directory)")
        try:  # a wrong option fails here, before anything starts (and again with the rest)
            parse_coordinator_argv(self.extra_coordinator_args)
        except ConfigError as exc:
            raise ConfigError(f"the sharded coordinators' options: {exc}") from None

    @property
    def prefixes(self) -> tuple[str, ...]:
        return tuple(f"hf:{{s{k}}}:" for k in range(self.shards))

    @property
    def tuner_prefix(self) -> str:
        """The tuner's ``--redis-prefix``, its records under ``P tuner:*``: the tuner's own
        default (on a Redis Cluster the one with a hash tag), outside every shard."""
        return DEFAULT_CLUSTER_PREFIX if self.redis_cluster else DEFAULT_REDIS_PREFIX


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
    redis_url: str = field(init=False, default="")
    """The Redis the mesh runs on, once started (the private one's, or the given one)."""
    redis_server: RedisServer | None = field(init=False, default=None)
    """The private Redis, while the mesh runs one."""
    auth: AuthDir | None = field(init=False, default=None)
    """The credentials of a secured mesh (`ShardedMeshConfig.auth_dir`); None: open."""

    def __post_init__(self) -> None:
        if self.config.auth_dir is not None:
            self.auth = AuthDir(self.config.auth_dir)

    @property
    def client_addresses(self) -> str:
        """Every coordinator's clients' door, comma-separated (what a client is given)."""
        return ",".join(c.listen for c in self.coordinators)

    def start(self) -> LocalShardedMesh:
        cfg = self.config
        cfg.logs.mkdir(parents=True, exist_ok=True)
        prefixes = cfg.prefixes
        if self.auth is not None:  # before Redis starts: it loads the ACL file
            self.auth.init(cfg.tenants, redis_prefix=cfg.tuner_prefix, shards=prefixes)
        if not cfg.redis_url:
            acl = self.auth.redis_acl if self.auth is not None else None
            self.redis_server = RedisServer(appendfsync="always", aclfile=acl, maxmemory="1gb")
            self.redis_url = self.redis_server.start()
        else:
            self.redis_url = cfg.redis_url
        # Shards first, so that each takes its own prefix before a spare could.
        for k in range(cfg.shards + cfg.spares):
            self.coordinators.append(self._coordinator(k, prefixes))
            if k == cfg.shards - 1:
                self._wait_leases(prefixes)
        doors = [c.worker_door for c in self.coordinators]
        for slot, instance in enumerate(parse_cluster(cfg.cluster).instances):
            settings = WorkerConfig(
                coordinator=doors[0],
                extra_coordinators=tuple(doors[1:]),
                worker_id=f"worker-{slot}",
                slot=slot,
                gpu=instance.gpu,
                calibration=cfg.calibration or None,
                log_level="WARNING",
            )
            argv = [
                sys.executable, "-m", "hexgen_worker",
                *worker_argv(settings, also=("slot",)),
                *self._token(),
                *self._secure("worker"),
            ]  # fmt: skip
            worker = ManagedProcess(f"worker {slot}", argv, cfg.logs / f"worker-{slot}.log")
            worker.start()
            self.workers.append(worker)
        if cfg.tuner:
            self.tuner_address = f"127.0.0.1:{free_port()}"
            redis_url, login = self._redis_login("tuner")
            argv = [
                sys.executable, "-m", "hexgen_tuner",
                *self.tuner_argv(self.tuner_address, redis_url),
                *login,
            ]  # fmt: skip
            self._service("tuner", argv)
        if cfg.gateway:
            self.gateway_address = f"127.0.0.1:{free_port()}"
            argv = [
                sys.executable, "-m", "hexgen_gateway",
                *self.gateway_argv(self.gateway_address),
            ]  # fmt: skip
            self._service("gateway", argv)
        return self

    # ------------------------------------------------- the tuner's and the gateway's options

    def tuner_argv(self, listen: str, redis_url: str) -> list[str]:
        """The tuner's options (but its Redis login), rendered through its settings
        (`hexgen_service.tuner_config`): every shard and every coordinator, its own records
        under `ShardedMeshConfig.tuner_prefix`, and a secured mesh's credentials."""
        cfg = self.config
        tuner = TunerConfig(
            **(secure_settings(self.auth, "tuner") if self.auth is not None else {}),
            listen=listen,
            coordinator=self.client_addresses,
            shards=cfg.prefixes,
            redis_url=redis_url,
            redis_prefix=cfg.tuner_prefix,
            redis_cluster=cfg.redis_cluster,
            period_s=cfg.tuner_period_s,
        )
        said = ("listen", "redis_url", "redis_prefix", "period_s")
        return render_tuner_argv(tuner, also=said)

    def gateway_argv(self, listen: str) -> list[str]:
        """The gateway's options, rendered through its settings
        (`hexgen_service.gateway_config`): every coordinator's address, and a secured
        mesh's credentials."""
        secured = secure_settings(self.auth, "gateway") if self.auth is not None else {}
        gateway = GatewayConfig(listen=listen, coordinator=self.client_addresses, **secured)
        return render_gateway_argv(gateway, also=("listen", "coordinator"))

    def coordinator_argv(self, listen: str, worker_listen: str, prefix: str) -> list[str]:
        """A coordinator's options, rendered through its settings
        (`hexgen_service.coordinator_config`): its two doors, the mesh's Redis (logged in as
        the coordinators' ACL user on a secured mesh's private Redis), every shard with
        `prefix` the one it prefers, the leases' and the resumes' timings, the cluster, the
        time scale and a secured mesh's credentials (`secure_settings`); then the files of
        its secrets (the Redis password, the workers' token) and
        `ShardedMeshConfig.extra_coordinator_args`. The whole is parsed back as the
        coordinator parses it (`parse_coordinator_argv`): a wrong option is a `ConfigError`
        here rather than a coordinator that exits."""
        cfg = self.config
        redis_url, login = self._redis_login("coordinator")
        settings = CoordinatorConfig(
            **(secure_settings(self.auth, "coordinator") if self.auth is not None else {}),
            listen=listen,
            worker_listen=worker_listen,
            redis_url=redis_url,
            redis_prefix=prefix,
            redis_cluster=cfg.redis_cluster,
            shards=cfg.prefixes,
            lease_ttl_s=cfg.lease_ttl_s,
            resume_grace_s=cfg.resume_grace_s,
            cluster=cfg.cluster,
            time_scale=cfg.time_scale,
            log_level=COORDINATOR_LOG_LEVEL,
        )
        argv = [
            *render_coordinator_argv(settings),
            *login,
            *self._token(),
            *cfg.extra_coordinator_args,
        ]
        try:
            parse_coordinator_argv(argv)
        except ConfigError as exc:
            raise ConfigError(f"the coordinator on {listen}: {exc}") from None
        return argv

    # ------------------------------------------------- what a secured mesh adds

    def _secure(self, service: str) -> list[str]:
        return secure_argv(self.auth, service) if self.auth is not None else []

    def _token(self) -> list[str]:
        """The workers' token, on the coordinators and the workers of a secured mesh."""
        if self.auth is None:
            return []
        return ["--worker-token-file", str(self.auth.worker_token)]

    @property
    def _login(self) -> AuthDir | None:
        """The credentials the services log in to Redis with, as ACL users: a secured
        mesh's, on its private Redis (a given Redis's URL says how to reach it, login
        included, as `LocalCluster`'s does); None: no login."""
        return self.auth if self.redis_server is not None else None

    def _redis_login(self, user: str) -> tuple[str, list[str]]:
        """The Redis URL `user` (coordinator, tuner) logs in with and its password option."""
        auth = self._login
        if auth is None:
            return self.redis_url, []
        return redis_login(self.redis_url, auth, user)

    def _redis(self) -> redis.Redis[bytes] | redis.RedisCluster[bytes]:
        """A client of the mesh's Redis, logged in as the coordinators are (their user
        reads every shard's lease and streams)."""
        url, _ = self._redis_login("coordinator")
        auth = self._login
        password = (
            read_secret(auth.redis_password("coordinator"), "redis password")
            if auth is not None
            else None
        )
        if self.config.redis_cluster:
            # one key per command: a cluster client sends each to its slot's master
            return redis.RedisCluster.from_url(url, password=password)
        return redis.Redis.from_url(url, password=password)

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
        client = self._redis()
        try:
            values = [
                client.get(redis_schema.key(p, redis_schema.LEASE)) for p in self.config.prefixes
            ]
        finally:
            client.close()
        return [v.decode() if v is not None else None for v in values]

    def completed_calls(self) -> Counter[str]:
        """How often each call id is in its shard's ``completions`` stream, over every shard
        (one entry per completion the shard applied: each call once, when none is lost and
        none is applied twice)."""
        client = self._redis()
        done: Counter[str] = Counter()
        try:
            for prefix in self.config.prefixes:
                entries = client.xrange(redis_schema.key(prefix, redis_schema.COMPLETIONS))
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
        if self.redis_server is not None:
            self.redis_server.stop()
            self.redis_server = None

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
        prefix = prefixes[k] if k < cfg.shards else SPARE_PREFIX
        options = self.coordinator_argv(listen, door, prefix)
        argv = [sys.executable, "-m", "hexgen_coordinator", *options]
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
