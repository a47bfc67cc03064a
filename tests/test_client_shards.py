"""`CoordinatorClient` in front of coordinator shards: it follows redirects and remembers
each query's owner, moves on past a coordinator that does not answer, and survives a shard
whose coordinator dies and is taken over at another address.

The shards are real gRPC servers in the test's process (tests/shard_redirect_server.py:
they own workflows by the coordinators' rule and redirect the rest in the coordinators'
format); each counts the RPCs it receives, so the tests count the hops. The coordinators'
own side (leases, takeover from Redis) is tests/test_coordinator_shards.py's.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

import httpx
import pytest

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_client.addresses import DEFAULT_COORDINATOR, split_addresses
from hexgen_client.client import CoordinatorClient
from hexgen_client.errors import CoordinatorUnavailableError, ShardRedirectLoopError
from hexgen_client.routing import MAX_REDIRECTS, ShardRouter
from hexgen_coordinator.shards import OWNER_METADATA, ShardMap
from hexgen_flow.errors import ConfigError
from hexgen_flow.traces import load_trace, take_queries
from hexgen_flow.workload import Query
from hexgen_gateway.__main__ import parse_config as parse_gateway
from hexgen_launch.processes import free_port
from hexgen_launch.replay import replay
from hexgen_service.errors import SHARD_OWNER_KEY
from shard_redirect_server import ShardServer, ShardTable, shard_of

TRACE = load_trace("trace1")


@dataclass
class Shards:
    """Two shards, each held by its own server; `spare` holds nothing and is not started."""

    table: ShardTable
    s0: ShardServer
    s1: ShardServer
    spare: ShardServer

    def query_of(self, shard: int, stem: str = "q") -> str:
        return self.table.ids_of(shard, 1, stem)[0]


@pytest.fixture
async def shards() -> AsyncIterator[Shards]:
    table = ShardTable(2)
    s0 = await ShardServer(table).take(0).start()
    s1 = await ShardServer(table).take(1).start()
    spare = ShardServer(table)
    try:
        yield Shards(table, s0, s1, spare)
    finally:
        for server in (s0, s1, spare):
            await server.stop()


def _dead_address() -> str:
    return f"127.0.0.1:{free_port()}"


# -------------------------------------------------------------------- the contract


def test_the_client_and_the_coordinators_agree_on_the_wire() -> None:
    assert OWNER_METADATA == SHARD_OWNER_KEY  # the trailer a redirect names its owner in
    rule = ShardMap(("hf:{s0}:", "hf:{s1}:", "hf:{s2}:"))
    assert all(rule.shard_of(f"q-{k}") == shard_of(f"q-{k}", 3) for k in range(200))


def test_addresses_are_one_a_comma_list_or_a_sequence() -> None:
    assert split_addresses("a:1") == ("a:1",)
    assert split_addresses(" a:1, b:2 ,a:1,") == ("a:1", "b:2")
    assert split_addresses(["a:1,b:2", "c:3"]) == ("a:1", "b:2", "c:3")
    with pytest.raises(ConfigError, match="no coordinator address"):
        split_addresses(" , ")
    client = CoordinatorClient(["a:1", "b:2"])
    assert (client.address, client.addresses) == ("a:1,b:2", ("a:1", "b:2"))
    assert CoordinatorClient("a:1").address == "a:1"


def test_the_router_keeps_a_bounded_memory_of_owners() -> None:
    router = ShardRouter(("a:1", "b:2"), owners_kept=2)
    for query_id, owner in (("q1", "b:2"), ("q2", "b:2"), ("q3", "a:1")):
        router.learn(query_id, owner)
    assert (router.owner("q1"), router.owner("q2"), router.owner("q3")) == (None, "b:2", "a:1")
    router.went_away("b:2")
    assert router.owner("q2") is None
    assert router.default == "a:1"
    router.went_away("a:1")
    assert (router.default, router.candidates()) == ("b:2", ("b:2", "a:1"))


def test_a_coordinator_that_answers_unavailable_stays_the_default() -> None:
    router = ShardRouter(("a:1", "b:2", "c:3"))
    route = router.route("q")
    takeover = "shard 1 (hf:{s1}:) has no coordinator now"
    answered = CoordinatorUnavailableError("a:1", takeover, answered=True)
    assert str(answered) == f"coordinator at a:1: UNAVAILABLE: {takeover}"
    assert route.reroute(answered, None) is None
    assert (route.address, router.default) == ("b:2", "a:1")  # it runs: ask it first still
    router.learn("q", "b:2")
    assert route.reroute(CoordinatorUnavailableError("b:2", "connection refused"), None) is None
    assert (route.address, router.owner("q")) == ("c:3", None)  # gone: forgotten as owner


# ------------------------------------------------------------------------ redirects


async def test_a_redirect_is_followed_and_the_owner_remembered(shards: Shards) -> None:
    theirs, ours = shards.query_of(1), shards.query_of(0)
    # Given only the first coordinator's address, the client still reaches the second.
    async with CoordinatorClient(shards.s0.address) as client:
        submitted = await client.submit(_query(theirs))
        assert submitted.created and submitted.query.query_id == theirs
        assert (shards.s0.rpcs["SubmitQuery"], shards.s1.rpcs["SubmitQuery"]) == (1, 1)
        for _ in range(3):  # straight to its owner from now on
            assert (await client.get(theirs)).query.state == cpb.QUERY_STATE_RUNNING
        assert (shards.s0.rpcs["GetQuery"], shards.s1.rpcs["GetQuery"]) == (0, 3)
        assert (await client.submit(_query(ours))).created  # its own: no hop
        assert (shards.s0.rpcs["SubmitQuery"], shards.s1.rpcs["SubmitQuery"]) == (2, 1)
        cancelled = await client.cancel(theirs)
        assert cancelled.state == cpb.QUERY_STATE_CANCELLED
        assert (shards.s0.rpcs["CancelQuery"], shards.s1.rpcs["CancelQuery"]) == (0, 1)
        # Per coordinator: ClusterStatus and SetAlpha go to the default one, unrouted.
        await client.status()
        await client.set_alpha(0.5)
        assert shards.s0.rpcs["ClusterStatus"] + shards.s0.rpcs["SetAlpha"] == 2
        assert shards.s1.rpcs["ClusterStatus"] + shards.s1.rpcs["SetAlpha"] == 0


async def test_streams_are_redirected_before_their_first_event(shards: Shards) -> None:
    watched, ran, session = (shards.query_of(1, stem) for stem in ("w", "r", "s"))
    shards.table.add(watched)
    async with CoordinatorClient([shards.s0.address, shards.s1.address]) as client:
        events = client.watch(watched)
        first = await anext(events)
        assert first.kind == cpb.QUERY_EVENT_KIND_SUBMITTED
        await shards.table.finish(watched)
        assert [e.kind async for e in events] == [cpb.QUERY_EVENT_KIND_SUCCEEDED]
        assert (shards.s0.rpcs["WatchQuery"], shards.s1.rpcs["WatchQuery"]) == (1, 1)

        run = client.run(_query(ran))
        assert (await anext(run)).kind == cpb.QUERY_EVENT_KIND_SUBMITTED
        await shards.table.finish(ran)
        assert [e.kind async for e in run] == [cpb.QUERY_EVENT_KIND_SUCCEEDED]
        assert (shards.s0.rpcs["RunQuery"], shards.s1.rpcs["RunQuery"]) == (1, 1)

        # A workflow session: opened through a redirect, its calls and close go straight.
        assert (await client.open_workflow(session, template="chess")).created
        responses = [r async for r in client.run_call(session, "plan", "hello")]
        assert responses[0].call_id == f"{session}/plan"
        assert responses[-1].event.text == f"{shards.s1.address} answers hello"
        assert (await client.close_workflow(session)).state == cpb.QUERY_STATE_SUCCEEDED
    rpcs = ("OpenWorkflow", "RunCall", "CloseWorkflow")
    assert [shards.s0.rpcs[r] for r in rpcs] == [1, 0, 0]
    assert [shards.s1.rpcs[r] for r in rpcs] == [1, 1, 1]


async def test_a_redirect_loop_is_a_clear_error() -> None:
    # Two coordinators that disagree on who owns shard 1: each names the other.
    first, second = ShardTable(2), ShardTable(2)
    s0 = await ShardServer(first).take(0).start()
    s1 = await ShardServer(second).take(0).start()
    first.holders[1], second.holders[1] = s1.address, s0.address
    query_id = first.ids_of(1, 1)[0]
    try:
        async with CoordinatorClient([s0.address, s1.address]) as client:
            with pytest.raises(ShardRedirectLoopError) as caught:
                await client.get(query_id)
            hops = f"{s0.address} -> {s1.address} -> {s0.address}"
            assert str(caught.value).startswith(
                f"query {query_id!r}: the coordinators keep redirecting it ({hops}); "
                "do they all run with the same --shards?"
            )
            assert (s0.rpcs["GetQuery"], s1.rpcs["GetQuery"]) == (1, 1)
            with pytest.raises(ShardRedirectLoopError):  # streams likewise
                async for _ in client.watch(query_id):
                    pass
    finally:
        await s0.stop()
        await s1.stop()


async def test_a_chain_of_redirects_stops_after_a_few_hops() -> None:
    # Each coordinator believes the next one owns shard 1: a chain, not a circle.
    tables = [ShardTable(2) for _ in range(MAX_REDIRECTS + 2)]
    servers = [await ShardServer(t).take(0).start() for t in tables]
    for here, there in zip(tables, servers[1:], strict=False):
        here.holders[1] = there.address
    query_id = tables[0].ids_of(1, 1)[0]
    try:
        async with CoordinatorClient(servers[0].address) as client:
            with pytest.raises(ShardRedirectLoopError) as caught:
                await client.get(query_id)
        assert len(caught.value.hops) == MAX_REDIRECTS + 2
        assert [s.rpcs["GetQuery"] for s in servers] == [1] * (MAX_REDIRECTS + 1) + [0]
    finally:
        for server in servers:
            await server.stop()


# ------------------------------------------------------------------- dead coordinators


async def test_a_dead_address_falls_over_to_the_next(shards: Shards) -> None:
    dead = _dead_address()
    theirs = shards.query_of(1)
    async with CoordinatorClient([dead, shards.s0.address, shards.s1.address]) as client:
        assert (await client.status()).policy == "hexgen-flow"
        assert client.router.default == shards.s0.address  # the dead one is tried last now
        assert (await client.submit(_query(theirs))).created
        assert (shards.s0.rpcs["SubmitQuery"], shards.s1.rpcs["SubmitQuery"]) == (1, 1)


async def test_every_address_unavailable_is_coordinator_unavailable(shards: Shards) -> None:
    dead = [_dead_address(), _dead_address()]
    async with CoordinatorClient(dead, timeout_s=2.0) as client:
        with pytest.raises(CoordinatorUnavailableError) as caught:
            await client.status()
        assert str(caught.value).startswith(
            f"no coordinator can serve the request now ({dead[0]}: "
        )
        assert caught.value.address == ",".join(dead)
        with pytest.raises(CoordinatorUnavailableError, match="no coordinator can serve query"):
            await client.get("q")
        with pytest.raises(CoordinatorUnavailableError):
            async for _ in client.watch("q"):
                pass
    # One address: the error it always was.
    async with CoordinatorClient(dead[0], timeout_s=2.0) as client:
        with pytest.raises(CoordinatorUnavailableError) as caught:
            await client.get("q")
        assert str(caught.value) == (
            f"cannot reach the coordinator at {dead[0]}: is `hexgen-flow up` running?"
        )


async def test_a_dead_shard_is_unavailable_until_taken_over(shards: Shards) -> None:
    theirs = shards.query_of(1)
    s0, s1 = shards.s0.address, shards.s1.address
    async with CoordinatorClient([s0, s1]) as client:
        await client.submit(_query(theirs))
        await shards.s1.stop()  # its lease still names it for a while
        with pytest.raises(CoordinatorUnavailableError) as caught:
            await client.get(theirs)
        message = str(caught.value)
        assert message.startswith(f"no coordinator can serve query {theirs!r} now ({s1}: ")
        assert f"{s0}: redirected to {s1})" in message
        shards.table.holders[1] = None  # the lease expired: a takeover is under way
        with pytest.raises(CoordinatorUnavailableError) as caught:
            await client.get(theirs)
        assert f"{s0}: shard 1 (hf:{{s1}}:) has no coordinator now" in str(caught.value)
        assert client.router.default == s0  # it answered: still the first to ask
        await shards.spare.take(1).start()
        got = await client.get(theirs)  # found at the successor, its state kept
        assert got.query.state == cpb.QUERY_STATE_RUNNING
        assert [e.kind for e in got.events] == [cpb.QUERY_EVENT_KIND_SUBMITTED]
        assert shards.spare.rpcs["GetQuery"] == 1
        await client.get(theirs)
        assert shards.spare.rpcs["GetQuery"] == 2
        assert shards.s0.rpcs["GetQuery"] == 3  # it redirected the three before


async def test_a_broken_watch_surfaces_and_the_rewatch_finds_the_successor(
    shards: Shards,
) -> None:
    theirs = shards.query_of(1)
    async with CoordinatorClient([shards.s0.address, shards.s1.address]) as client:
        await client.submit(_query(theirs))  # its owner is remembered: s1
        events = client.watch(theirs)
        assert (await anext(events)).kind == cpb.QUERY_EVENT_KIND_SUBMITTED
        await shards.s1.stop()
        with pytest.raises(CoordinatorUnavailableError):
            await anext(events)
        # Forgotten as its owner at once: a re-watch asks the others, not the dead address
        # first (where a dead pod's address may take a connect timeout to fail).
        assert client.router.owner(theirs) is None
        await shards.spare.take(1).start()
        rewatch = client.watch(theirs)  # not to the dead address again
        assert (await anext(rewatch)).kind == cpb.QUERY_EVENT_KIND_SUBMITTED
        await shards.table.finish(theirs)
        assert [e.kind async for e in rewatch] == [cpb.QUERY_EVENT_KIND_SUCCEEDED]
    assert (shards.s0.rpcs["WatchQuery"], shards.spare.rpcs["WatchQuery"]) == (1, 1)


async def test_replay_survives_a_shard_taken_over_mid_run(shards: Shards) -> None:
    """`replay`'s own retries (submissions, re-watches) carry it through the takeover."""
    queries = take_queries(TRACE, 8)
    assert {shard_of(q.query_id, 2) for q in queries} == {0, 1}
    table = shards.table
    async with CoordinatorClient([shards.s0.address, shards.s1.address]) as client:
        run = asyncio.create_task(replay(client, queries, qps=100.0, retry_s=20.0))
        await _until(lambda: len(table.queries) == len(queries))
        await shards.s1.stop()
        table.holders[1] = None
        await asyncio.sleep(0.7)  # a re-watch or two find no coordinator for shard 1
        await shards.spare.take(1).start()
        for query in queries:
            await table.finish(query.query_id)
        metrics = await asyncio.wait_for(run, timeout=30)
    assert metrics.num_queries == len(queries)
    assert metrics.extra["admitted"] == len(queries) and metrics.extra["failed"] == 0
    of_shard_1 = sum(shard_of(q.query_id, 2) == 1 for q in queries)
    assert shards.spare.rpcs["GetQuery"] == of_shard_1  # each read its end at the successor


# -------------------------------------------------------------------- the gateway


def test_the_gateway_takes_several_coordinators_repeated_or_comma_separated() -> None:
    config, _ = parse_gateway(["--coordinator", "a:1,b:2", "--coordinator", "c:3"])
    assert config.coordinator == "a:1,b:2,c:3"
    assert parse_gateway([])[0].coordinator == DEFAULT_COORDINATOR


async def test_the_gateway_sends_each_workflow_to_its_shard(shards: Shards) -> None:
    dead = _dead_address()
    theirs, ours = shards.query_of(1, "w"), shards.query_of(0, "w")
    # The first coordinator it is given is dead: it passes over it, and follows redirects.
    flags = ("--coordinator", f"{dead},{shards.s0.address}", "--coordinator", shards.s1.address)
    async with _gateway(*flags) as base_url, httpx.AsyncClient(base_url=base_url) as http:
        for workflow, owner in ((theirs, shards.s1), (ours, shards.s0)):
            answer = await http.post(
                "/completions",
                json={"prompt": "hi", "max_tokens": 8},
                headers={"X-Hexgen-Workflow": workflow, "X-Hexgen-Stage": "plan"},
                timeout=30,
            )
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"] == f"{owner.address} answers hi"
        closed = await http.post(f"/workflows/{theirs}/close", timeout=30)
        assert closed.status_code == 200, closed.text
    assert [shards.s0.rpcs[r] for r in ("OpenWorkflow", "RunCall", "CloseWorkflow")] == [2, 1, 0]
    assert [shards.s1.rpcs[r] for r in ("OpenWorkflow", "RunCall", "CloseWorkflow")] == [1, 1, 1]
    assert shards.table.queries[theirs].state == cpb.QUERY_STATE_SUCCEEDED


@asynccontextmanager
async def _gateway(*args: str) -> AsyncIterator[str]:
    """`python -m hexgen_gateway ARGS` on a free port; its API's base URL once it answers."""
    listen = f"127.0.0.1:{free_port()}"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hexgen_gateway", "--listen", listen, *args,
        "--log-level", "WARNING", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        async with httpx.AsyncClient() as http:
            for _ in range(300):
                assert proc.returncode is None, "the gateway exited"
                try:
                    await http.get(f"http://{listen}/health", timeout=2)
                    break
                except httpx.TransportError:
                    await asyncio.sleep(0.1)
        yield f"http://{listen}/v1"
    finally:
        proc.terminate()
        await proc.communicate()


# -------------------------------------------------------------------------- helpers


def _query(query_id: str) -> Query:
    return replace(TRACE[0], query_id=query_id)


async def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.02)
