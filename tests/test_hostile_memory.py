"""Rejected bytes cost no memory: floods of huge requests against `hexgen-flow up`, plain and
`--secure`, authenticated or not, leave the coordinator's resident memory where it was.

Each door reads at most what its methods take (`hexgen_coordinator.edge.door_limit`): gRPC
refuses a larger request from its length prefix, unread; a request within the door's limit
but over its method's is refused unparsed; an unauthenticated one is refused from its
metadata before its body is read; and what was read is given back to the system
(`hexgen_service.heap`). `benchmarks/hostile_load.py` prints the same figures, with the
event loop's longest stall during the flood.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_api.v1 import workflow_pb2 as wfpb
from hexgen_service.auth_dir import AuthDir
from redis_here import needs_redis
from up_runner import Up, running_up

pytestmark = needs_redis

SUBMIT = "/hexgen_flow.v1.CoordinatorService/SubmitQuery"
GET = "/hexgen_flow.v1.CoordinatorService/GetQuery"
OPTIONS = ("--cluster", "A100,A100", "--no-tuner", "--no-gateway", "--time-scale", "20")


def _submission(megabytes: int) -> bytes:
    """A SubmitQuery of about `megabytes` MB: one call whose prompt is that big."""
    prompt = "x" * (megabytes << 20)
    call = wfpb.LLMCall(input_tokens=10, output_tokens=5, prompt=prompt)
    workflow = wfpb.Workflow(stages=[wfpb.Stage(id="a", step="s", calls=[call])])
    return cpb.SubmitQueryRequest(query_id="big", workflow=workflow).SerializeToString()


def _get(megabytes: int) -> bytes:
    """A GetQuery of about `megabytes` MB (an id of that size)."""
    return cpb.GetQueryRequest(query_id="q" * (megabytes << 20)).SerializeToString()


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _flood(
    channel: grpc.Channel, method: str, body: bytes, n: int, key: str | None = None
) -> Counter[str]:
    """`n` concurrent calls of `method` with `body` (bytes as they are, no serializing in
    this process); how they ended: the status and the gist of its message."""
    rpc: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
        method, request_serializer=None, response_deserializer=None
    )
    metadata = (("authorization", f"Bearer {key}"),) if key else None

    def one(_: int) -> str:
        try:
            rpc(body, metadata=metadata, timeout=60)
        except grpc.RpcError as exc:
            assert isinstance(exc, grpc.Call)
            return f"{exc.code().name}: {_GIST.get(exc.code(), lambda d: d)(exc.details() or '')}"
        return "OK"

    with ThreadPoolExecutor(n) as pool:
        return Counter(pool.map(one, range(n)))


TOO_LARGE = "RESOURCE_EXHAUSTED: larger than the door takes"
NO_KEY = "UNAUTHENTICATED: no API key"
_GIST = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: lambda d: (
        "larger than the door takes" if "Received message larger than max" in d else d
    ),
    grpc.StatusCode.UNAUTHENTICATED: lambda d: "no API key" if "no API key" in d else d,
    grpc.StatusCode.INVALID_ARGUMENT: lambda d: d.split(" (")[0].split(", ")[0],
}


def _settled_rss(up: Up, start_mb: float) -> float:
    """The coordinator's resident memory once it is back within `SETTLED_MB` of `start_mb`,
    or after `SETTLE_S`, whichever comes first. The heap trimmer gives a burst back a
    second after it ends; a burst that outlasted its retries (a flood on a loaded machine)
    is given back at the raised floor's recheck, 10 s later (`hexgen_service.heap`)."""
    import time

    pid = up.service_pid("hexgen_coordinator")
    deadline = time.monotonic() + SETTLE_S
    while True:
        time.sleep(1.0)
        rss = _rss_mb(pid)
        if rss - start_mb < SETTLED_MB or time.monotonic() > deadline:
            return rss


SETTLED_MB = 150
"""What one round of the three floods may leave behind. Measured on 2-core machines: with the
trimmer off, 213-232 MB stays; with it, 2-85 MB here and 107 MB once in CI. What a trim
cannot give back varies with how the concurrent requests' buffers fell in the allocator's
arenas (the trimmer's log shows each trim: `_heap_log`); the test also checks the trimmer is
on, so a failure of either kind tells which."""
SETTLE_S = 30.0


def _heap_log(up: Up) -> list[str]:
    """What the coordinator's heap trimmer logged (`hexgen_service.heap`): whether it is on,
    and its trims."""
    log = (up.log_dir / "coordinator.log").read_text()
    return [line for line in log.splitlines() if "heap trim" in line]


def _trimming(up: Up) -> None:
    """The memory given back is the trimmer's doing: it must be on in the coordinator."""
    lines = _heap_log(up)
    assert any("heap trimmer on" in line for line in lines), lines


def _memory_report(pid: int) -> str:
    """Where a process's resident memory lies: its totals by kind, its threads, and its five
    largest mappings (for a failure's message: a heap the trimmer should have given back
    reads differently from gRPC's buffers, a file or shared memory)."""
    proc = Path(f"/proc/{pid}")
    kinds = ("Rss:", "Anonymous:", "AnonHugePages:", "Shared_Clean:", "Private_Dirty:")
    lines = [
        line for line in (proc / "smaps_rollup").read_text().splitlines() if line.startswith(kinds)
    ]
    threads = len(list((proc / "task").iterdir()))
    maps: list[tuple[int, str]] = []
    name = ""
    for line in (proc / "smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            name = f"{fields[0]} {fields[5] if len(fields) > 5 else '[anon]'}"
        elif fields[0] == "Rss:":
            maps.append((int(fields[1]), name))
    largest = [f"{kb >> 10} MB {where}" for kb, where in sorted(maps, reverse=True)[:5]]
    return "; ".join([*lines, f"threads {threads}", *largest])


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    with running_up(tmp_path_factory.mktemp("plain"), *OPTIONS) as up:
        yield up


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Up, AuthDir]]:
    folder = tmp_path_factory.mktemp("secure")
    auth = AuthDir(folder / "auth")
    with running_up(folder, "--secure", "--auth-dir", str(auth.path), "--tenants", "a",
                    *OPTIONS) as up:  # fmt: skip
        yield up, auth


def test_a_flood_of_huge_requests_leaves_memory_where_it_was(plain: Up) -> None:
    _trimming(plain)
    pid = plain.service_pid("hexgen_coordinator")
    start = _rss_mb(pid)
    with grpc.insecure_channel(
        plain.coordinator, options=[("grpc.max_send_message_length", -1)]
    ) as channel:
        # Beyond the door: refused from the length prefix, never read.
        huge = _flood(channel, SUBMIT, _submission(60), 16)
        assert list(huge) == [TOO_LARGE], huge
        # Within the door, beyond GetQuery's own limit: refused unparsed.
        long_ids = _flood(channel, GET, _get(6), 16)
        assert list(long_ids) == [f"INVALID_ARGUMENT: request: {len(_get(6))} bytes"], long_ids
        # Within SubmitQuery's limit, refused by a field check: read, parsed, given back.
        too_long = _flood(channel, SUBMIT, _submission(7), 16)
        assert list(too_long) == [
            "INVALID_ARGUMENT: workflow.stages[0].calls[0].prompt: must be at most 1048576 bytes"
        ], too_long
    after = _settled_rss(plain, start)
    print(f"\ncoordinator RSS: {start:.0f} MB before, {after:.0f} MB after the floods")
    assert after - start < SETTLED_MB, (start, after, _memory_report(pid), _heap_log(plain))


def test_unauthenticated_floods_are_refused_before_their_bodies_are_read(
    secure: tuple[Up, AuthDir],
) -> None:
    up, auth = secure
    _trimming(up)
    pid = up.service_pid("hexgen_coordinator")
    start = _rss_mb(pid)
    credentials = grpc.ssl_channel_credentials(auth.ca.read_bytes())
    options = [("grpc.max_send_message_length", -1)]
    key = auth.tenant_key("a").read_text().strip()
    with grpc.secure_channel(up.coordinator, credentials, options=options) as channel:
        for body in (_submission(60), _submission(7), _get(6)):
            codes = _flood(channel, SUBMIT if len(body) > (6 << 20) + 64 else GET, body, 16)
            assert set(codes) <= {NO_KEY, TOO_LARGE}, codes
        huge = _flood(channel, SUBMIT, _submission(60), 16, key)
        assert list(huge) == [TOO_LARGE], huge
    after = _settled_rss(up, start)
    print(f"\ncoordinator RSS: {start:.0f} MB before, {after:.0f} MB after the floods")
    assert after - start < SETTLED_MB, (start, after, _memory_report(pid), _heap_log(up))
