// Shard routing against real servers.
//
// HEXGEN_COORDINATOR_SHARDED: the comma list of a sharded mesh's coordinators, shard k's
// first (`hexgen-flow up --shards 2 --spares 0` prints it; scripts/test_clients.py starts
// one). Workflows of both shards go in through one address (those of the other shard are
// redirected) and through every address with a dead one in front, and all complete.
//
// HEXGEN_SHARD_FIXTURES: the JSON line `python tests/shard_redirect_server.py` prints
// (scripts/test_clients.py starts it): small gRPC servers that redirect as coordinators do
// but are set up to disagree: a circle of redirects ("loop"), a chain longer than a client
// follows ("chain"), a shard without a holder ("takeover"), and two shards of one table
// ("shards"; a query submitted there stays RUNNING, and a session's call is answered
// "ADDRESS answers PROMPT" by the coordinator that served it).
//
// Without them, their tests are skipped.
import assert from "node:assert/strict";
import { createServer } from "node:net";
import { describe, test } from "node:test";

import {
  CoordinatorClient,
  CoordinatorUnavailableError,
  MAX_REDIRECTS,
  QueryEventKind,
  QueryState,
  ShardRedirectLoopError,
  StatusCode,
  type DeepPartial,
  type QueryEvent,
  type SubmitQueryRequest,
} from "../src/index.js";
import { collect, rejection } from "./helpers.js";

const TIMEOUT_MS = 90_000;
const sharded = process.env["HEXGEN_COORDINATOR_SHARDED"];
const skipSharded = sharded ? false : "HEXGEN_COORDINATOR_SHARDED is not set (a sharded mesh's coordinators, A,B)";
const fixturesJson = process.env["HEXGEN_SHARD_FIXTURES"];
const skipFixtures = fixturesJson
  ? false
  : "HEXGEN_SHARD_FIXTURES is not set (the JSON line of `python tests/shard_redirect_server.py`)";

const run = `${Date.now().toString(36)}-${process.pid}`;

const CRC_TABLE = Array.from({ length: 256 }, (_, n) => {
  let c = n;
  for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
  return c >>> 0;
});

/** The shard that owns `queryId`: the coordinators' rule, crc32(UTF-8 id) mod N (the client
 * itself needs no such map: it learns from redirects). */
function shardOf(queryId: string, shards: number): number {
  let crc = 0xffffffff;
  for (const byte of Buffer.from(queryId, "utf8")) crc = (CRC_TABLE[(crc ^ byte) & 0xff] as number) ^ (crc >>> 8);
  return ((crc ^ 0xffffffff) >>> 0) % shards;
}

/** `count` fresh query ids of each of two shards, by shard. */
function idsOf(stem: string, count: number): [string[], string[]] {
  const out: [string[], string[]] = [[], []];
  for (let k = 0; out[0].length < count || out[1].length < count; k++) {
    const queryId = `ts-shards-${stem}-${run}-${k}`;
    const of = out[shardOf(queryId, 2)] as string[];
    if (of.length < count) of.push(queryId);
  }
  return out;
}

/** A loopback address where nothing listens. */
async function deadAddress(): Promise<string> {
  const port = await new Promise<number>((resolve, reject) => {
    const server = createServer();
    server.once("error", reject);
    server.listen(0, "127.0.0.1", () => {
      const address = server.address();
      server.close(() => resolve(typeof address === "object" && address ? address.port : 0));
    });
  });
  return `127.0.0.1:${port}`;
}

function smallWorkflow(): DeepPartial<SubmitQueryRequest>["workflow"] {
  return {
    stages: [
      { id: "plan", step: "extract_keywords", calls: [{ inputTokens: 300, outputTokens: 16 }] },
      { id: "pick", step: "evaluate", after: ["plan"], calls: [{ inputTokens: 400, outputTokens: 8 }] },
    ],
  };
}

/** Run every query at once through `client`, half by submit then watch, half by run; each
 * must succeed. */
async function runAll(client: CoordinatorClient, queryIds: string[]): Promise<void> {
  await Promise.all(
    queryIds.map(async (queryId, k) => {
      let events: QueryEvent[];
      if (k % 2 === 0) {
        const submitted = await client.submit({ queryId, workflow: smallWorkflow(), sloScale: 5 });
        assert.equal(submitted.created, true, queryId);
        events = await collect(client.watch(queryId));
      } else {
        events = await collect(client.run({ queryId, workflow: smallWorkflow(), sloScale: 5 }));
      }
      assert.equal(events.at(-1)?.kind, QueryEventKind.QUERY_EVENT_KIND_SUCCEEDED, `${queryId} (shard ${shardOf(queryId, 2)})`);
    }),
  );
}

describe("a sharded mesh", () => {
  test("workflows through one coordinator and through all of them complete", { skip: skipSharded, timeout: TIMEOUT_MS }, async () => {
    const addrs = (sharded ?? "").split(",");
    assert.equal(addrs.length, 2, `HEXGEN_COORDINATOR_SHARDED=${sharded}: want the two coordinators of up --shards 2 --spares 0`);
    // Through the first coordinator alone: the second shard's workflows are redirected.
    const one = new CoordinatorClient(addrs[0] as string);
    const dead = await deadAddress();
    const all = new CoordinatorClient([dead, sharded as string]);
    try {
      await one.waitForReady(10_000);
      for (let tries = 0; ; tries++) {
        const status = await one.status();
        if (status.instances.length > 0 && status.instances.every((instance) => instance.connected)) break;
        assert.ok(tries < 300, "the sharded mesh's workers did not connect");
        await new Promise((resolve) => setTimeout(resolve, 100));
      }
      const ids = idsOf("one", 3);
      await runAll(one, [...ids[0], ...ids[1]]);
      for (const queryId of ids[0]) assert.equal(one.router.owner(queryId), undefined, "its own shard's: no redirect");
      for (const queryId of ids[1]) assert.equal(one.router.owner(queryId), addrs[1], "learnt from the redirect");

      // A session of the second shard: opened through a redirect, its call and close go to
      // the owner straight.
      const session = idsOf("session", 1)[1][0] as string;
      const expected = { stages: [{ id: "plan", step: "plan", calls: [{ inputTokens: 300, outputTokens: 16 }] }] };
      assert.equal((await one.openWorkflow({ workflowId: session, expected, sloScale: 5 })).created, true);
      const responses = await collect(one.runCall(session, "plan", { prompt: "hello", outputTokens: 16 }));
      assert.equal(responses.at(-1)?.event?.kind, QueryEventKind.QUERY_EVENT_KIND_CALL_FINISHED);
      await one.closeWorkflow(session);
      const ended = await collect(one.watch(session));
      assert.equal(ended.at(-1)?.kind, QueryEventKind.QUERY_EVENT_KIND_SUCCEEDED);

      // Every address, a dead one in front: passed over, and every workflow completes, those
      // submitted before too (found through redirects by a fresh client).
      const more = idsOf("all", 2);
      await runAll(all, [...more[0], ...more[1]]);
      assert.equal(all.router.default, addrs[0], "the dead address is tried last now");
      for (const queryId of more[1]) assert.equal(all.router.owner(queryId), addrs[1]);
      for (const queryId of [...ids[0], ...ids[1]]) {
        assert.equal((await all.get(queryId)).query?.state, QueryState.QUERY_STATE_SUCCEEDED, queryId);
      }
    } finally {
      one.close();
      all.close();
    }
  });
});

interface Fixtures {
  loop: string;
  chain: string;
  takeover: string;
  shards: string;
  query: string;
}

describe("coordinators that redirect in circles (tests/shard_redirect_server.py)", () => {
  const fixtures: Fixtures = fixturesJson
    ? (JSON.parse(fixturesJson) as Fixtures)
    : { loop: "", chain: "", takeover: "", shards: "", query: "" };
  const it = (name: string, fn: () => Promise<void>) => test(name, { skip: skipFixtures, timeout: 30_000 }, fn);

  it("a circle of redirects is ShardRedirectLoopError naming the path", async () => {
    const [a, b] = fixtures.loop.split(",");
    const client = new CoordinatorClient(fixtures.loop);
    try {
      const error = await rejection(client.get(fixtures.query));
      assert.ok(error instanceof ShardRedirectLoopError, error.message);
      assert.deepEqual(error.hops, [a, b, a]);
      assert.equal(error.code, StatusCode.FAILED_PRECONDITION);
      assert.equal(error.queryId, fixtures.query);
      assert.ok(
        error.message.startsWith(
          `query '${fixtures.query}': the coordinators keep redirecting it (${a} -> ${b} -> ${a}); ` +
            "do they all run with the same --shards?",
        ),
        error.message,
      );
      // Streams likewise, before their first response.
      assert.ok((await rejection(collect(client.watch(fixtures.query)))) instanceof ShardRedirectLoopError);
      assert.ok((await rejection(collect(client.runCall(fixtures.query, "plan", "hi")))) instanceof ShardRedirectLoopError);
    } finally {
      client.close();
    }
  });

  it("a chain of redirects stops after MAX_REDIRECTS hops", async () => {
    const chain = fixtures.chain.split(",");
    assert.equal(chain.length, MAX_REDIRECTS + 2);
    const client = new CoordinatorClient(chain[0] as string);
    try {
      const error = await rejection(client.get(fixtures.query));
      assert.ok(error instanceof ShardRedirectLoopError, error.message);
      assert.deepEqual(error.hops, chain);
    } finally {
      client.close();
    }
  });

  it("a shard without a holder falls over to the next address", async () => {
    const dead = await deadAddress();
    const client = new CoordinatorClient([fixtures.takeover, dead]);
    const alone = new CoordinatorClient(fixtures.takeover);
    try {
      const error = await rejection(client.get(fixtures.query));
      assert.ok(error instanceof CoordinatorUnavailableError, error.message);
      assert.equal(error.address, `${fixtures.takeover},${dead}`);
      const takeover = "shard 1 (hf:{s1}:) has no coordinator now";
      assert.ok(
        error.message.startsWith(
          `no coordinator can serve query '${fixtures.query}' now (${fixtures.takeover}: ${takeover}; ${dead}: no answer)`,
        ),
        error.message,
      );
      assert.equal(client.router.default, fixtures.takeover, "it answered: still the first asked");
      assert.ok((await rejection(collect(client.watch(fixtures.query)))) instanceof CoordinatorUnavailableError);
      // One address: its own answer, as without shards.
      const own = await rejection(alone.get(fixtures.query));
      assert.ok(own instanceof CoordinatorUnavailableError && own.answered, own.message);
      assert.equal(own.message, `coordinator at ${fixtures.takeover}: UNAVAILABLE: ${takeover}`);
    } finally {
      client.close();
      alone.close();
    }
  });

  it("redirects are followed and the owner remembered, streams included", async () => {
    const [s0, s1] = fixtures.shards.split(",") as [string, string];
    const dead = await deadAddress();
    // Given a dead address and the first coordinator only, it reaches the second.
    const client = new CoordinatorClient(`${dead},${s0}`);
    try {
      await client.status();
      assert.equal(client.router.default, s0);
      const theirs = idsOf("fixture", 1)[1][0] as string;
      const submitted = await client.submit({ queryId: theirs, workflow: smallWorkflow() });
      assert.equal(submitted.created, true);
      assert.equal(client.router.owner(theirs), s1);
      for await (const event of client.watch(theirs)) {
        assert.equal(event.kind, QueryEventKind.QUERY_EVENT_KIND_SUBMITTED);
        break;
      }
      assert.equal((await client.cancel(theirs)).query?.state, QueryState.QUERY_STATE_CANCELLED);

      // A session: each RPC at the owner, whose answer names it.
      const session = idsOf("fixture-session", 1)[1][0] as string;
      await client.openWorkflow({ workflowId: session, template: "chess" });
      const responses = await collect(client.runCall(session, "plan", "hello"));
      assert.equal(responses.at(-1)?.event?.text, `${s1} answers hello`);
      assert.equal((await client.closeWorkflow(session)).workflow?.state, QueryState.QUERY_STATE_SUCCEEDED);
    } finally {
      client.close();
    }
  });
});
