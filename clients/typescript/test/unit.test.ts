// Unit tests that need no coordinator: the metadata a call sends, how a grpc-js error
// becomes a CoordinatorError (field, retry-after-s, subclasses), an address where nothing
// listens, and the shard routing's rules (the router's memory, redirects, loops). What the coordinator answers is tested live (live.test.ts).
import assert from "node:assert/strict";
import { createServer } from "node:net";
import { test } from "node:test";

import { Metadata, Server, ServerCredentials, status, type sendUnaryData, type ServerUnaryCall } from "@grpc/grpc-js";

import {
  API_KEY_ENV,
  ClusterStatusResponse,
  CoordinatorClient,
  CoordinatorServiceService,
  CoordinatorError,
  CoordinatorOverloadedError,
  CoordinatorUnavailableError,
  MAX_REDIRECTS,
  SHARD_OWNER_KEY,
  ShardRedirectLoopError,
  ShardRouter,
  StatusCode,
  TLS_CA_ENV,
  ownerOf,
  splitAddresses,
  type CallOptions,
  type ClusterStatusRequest,
} from "../src/index.js";
import { toCoordinatorError } from "../src/errors.js";

/** What grpc-js rejects a call with: an Error with code, details and trailing metadata. */
function serviceError(code: status, details: string, trailers: Record<string, string> = {}): Error {
  const metadata = new Metadata();
  for (const [key, value] of Object.entries(trailers)) metadata.set(key, value);
  return Object.assign(new Error(`${code} ${status[code]}: ${details}`), { code, details, metadata });
}

test("traceparent, tracestate and metadata go into a call's metadata", () => {
  const client = new CoordinatorClient("127.0.0.1:1", { metadata: { "X-Client": "ts-test", "x-tenant-hint": "k" } });
  try {
    // callMetadata is private: reached by name, as a unit test may.
    const metadataOf = (options?: CallOptions) => client["callMetadata"](options);
    const traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    const metadata = metadataOf({
      traceparent,
      tracestate: "k=v",
      metadata: { "X-Extra": "1", "x-tenant-hint": "call" },
      apiKey: "call-key",
    });
    assert.deepEqual(metadata.get("traceparent"), [traceparent]);
    assert.deepEqual(metadata.get("tracestate"), ["k=v"]);
    assert.deepEqual(metadata.get("x-extra"), ["1"]);
    assert.deepEqual(metadata.get("x-client"), ["ts-test"]);
    assert.deepEqual(metadata.get("x-tenant-hint"), ["call"], "the call's metadata wins over the client's");
    assert.deepEqual(metadata.get("authorization"), ["Bearer call-key"], "a call's own API key");

    const plain = metadataOf();
    assert.deepEqual(plain.get("traceparent"), [], "no traceparent unless given");
    assert.deepEqual(plain.get("x-client"), ["ts-test"]);
  } finally {
    client.close();
  }
});

test("RESOURCE_EXHAUSTED becomes CoordinatorOverloadedError with retryAfterS", () => {
  const error = toCoordinatorError(
    serviceError(status.RESOURCE_EXHAUSTED, "1 queries are running (the coordinator's limit: 1)", {
      "retry-after-s": "1.250",
    }),
    "127.0.0.1:1",
  );
  assert.ok(error instanceof CoordinatorOverloadedError);
  assert.equal(error.code, StatusCode.RESOURCE_EXHAUSTED);
  assert.equal(error.codeName, "RESOURCE_EXHAUSTED");
  assert.equal(error.retryAfterS, 1.25);
  assert.equal(error.address, "127.0.0.1:1");
  assert.match(error.message, /RESOURCE_EXHAUSTED: 1 queries are running/);

  const unparsable = toCoordinatorError(
    serviceError(status.RESOURCE_EXHAUSTED, "x", { "retry-after-s": "soon" }),
    "a",
  );
  assert.ok(unparsable instanceof CoordinatorError);
  assert.equal(unparsable.retryAfterS, undefined);
});

test("status codes and details become CoordinatorErrors naming the field", () => {
  const invalid = toCoordinatorError(
    serviceError(status.INVALID_ARGUMENT, "workflow.stages[0].calls[0].output_tokens: must be in [1, 10000000], got -1"),
    "a",
  );
  assert.ok(invalid instanceof CoordinatorError && !(invalid instanceof CoordinatorOverloadedError));
  assert.equal(invalid.field, "workflow.stages[0].calls[0].output_tokens");
  assert.equal(invalid.retryAfterS, undefined);

  const noField = toCoordinatorError(serviceError(status.NOT_FOUND, "no query 'q': gone"), "a");
  assert.ok(noField instanceof CoordinatorError);
  assert.equal(noField.field, undefined);

  const redis = toCoordinatorError(serviceError(status.UNAVAILABLE, "redis unavailable: connection refused, retry"), "a");
  assert.ok(redis instanceof CoordinatorUnavailableError);
  assert.match(redis.message, /UNAVAILABLE: redis unavailable/);

  const other = new TypeError("not a grpc error");
  assert.equal(toCoordinatorError(other, "a"), other, "other errors pass through");
});

test("nothing listening is CoordinatorUnavailableError", async () => {
  // A port nobody listens on: bound by the OS, then closed.
  const port = await new Promise<number>((resolve, reject) => {
    const server = createServer();
    server.once("error", reject);
    server.listen(0, "127.0.0.1", () => {
      const address = server.address();
      server.close(() => resolve(typeof address === "object" && address ? address.port : 0));
    });
  });
  const client = new CoordinatorClient(`127.0.0.1:${port}`);
  try {
    const error = await client.status().catch((error: unknown) => error);
    assert.ok(error instanceof CoordinatorUnavailableError, String(error));
    assert.equal(error.code, StatusCode.UNAVAILABLE);
    assert.match(error.message, /cannot reach the coordinator/);
    const waited = await client.waitForReady(300).catch((error: unknown) => error);
    assert.ok(waited instanceof CoordinatorUnavailableError, String(waited));
  } finally {
    client.close();
  }
});

test("the API key goes with every call as authorization: Bearer, over plaintext too", async () => {
  // A local plaintext server that answers ClusterStatus with nothing, recording the key.
  const seen: string[] = [];
  const server = new Server();
  server.addService(CoordinatorServiceService, {
    clusterStatus(call: ServerUnaryCall<ClusterStatusRequest, ClusterStatusResponse>, done: sendUnaryData<ClusterStatusResponse>) {
      seen.push(String(call.metadata.get("authorization")[0] ?? "(none)"));
      done(null, ClusterStatusResponse.fromPartial({}));
    },
  });
  const port = await new Promise<number>((resolve, reject) =>
    server.bindAsync("127.0.0.1:0", ServerCredentials.createInsecure(), (error, port) =>
      error ? reject(error) : resolve(port),
    ),
  );
  const saved = { key: process.env[API_KEY_ENV], ca: process.env[TLS_CA_ENV] };
  const clients: CoordinatorClient[] = [];
  const make = (options: ConstructorParameters<typeof CoordinatorClient>[1] = {}) => {
    const client = new CoordinatorClient(`127.0.0.1:${port}`, options);
    clients.push(client);
    return client;
  };
  try {
    delete process.env[TLS_CA_ENV];
    process.env[API_KEY_ENV] = "from-env";
    await make().status(); // the environment's key
    await make({ apiKey: "given" }).status(); // the option wins
    await make({ apiKey: "" }).status(); // "": none
    const given = make({ apiKey: "given" });
    await given.status({ apiKey: "per-call" }); // the call's key wins
    await new Promise<void>((resolve, reject) =>
      given.stub.clusterStatus({}, (error) => (error ? reject(error) : resolve())),
    ); // the raw stub's calls carry it too
    delete process.env[API_KEY_ENV];
    await make().status(); // nothing anywhere: none
    assert.deepEqual(seen, [
      "Bearer from-env",
      "Bearer given",
      "(none)",
      "Bearer per-call",
      "Bearer given",
      "(none)",
    ]);
  } finally {
    for (const client of clients) client.close();
    if (saved.key === undefined) delete process.env[API_KEY_ENV];
    else process.env[API_KEY_ENV] = saved.key;
    if (saved.ca === undefined) delete process.env[TLS_CA_ENV];
    else process.env[TLS_CA_ENV] = saved.ca;
    server.forceShutdown();
  }
});

test("a CA file that cannot be read fails the constructor", () => {
  assert.throws(() => new CoordinatorClient("127.0.0.1:1", { tlsCa: "/nonexistent/ca.pem" }), /ENOENT/);
});

// ------------------------------------------------------------------ shard routing
// The same cases as tests/test_client_shards.py's for the Python client; against real
// servers: shards.test.ts.

/** A coordinator's redirect: FAILED_PRECONDITION naming the owner in its trailer. */
function redirect(queryId: string, owner: string): CoordinatorError {
  const error = toCoordinatorError(
    serviceError(status.FAILED_PRECONDITION, `query '${queryId}' belongs to shard 1 (hf:{s1}:), served at ${owner}`, {
      [SHARD_OWNER_KEY]: owner,
    }),
    "x",
  );
  assert.ok(error instanceof CoordinatorError);
  return error;
}

test("addresses are one, a comma list or an array", () => {
  assert.deepEqual(splitAddresses("a:1, b:2,,"), ["a:1", "b:2"]);
  assert.deepEqual(splitAddresses(["a:1,b:2", "c:3", "a:1"]), ["a:1", "b:2", "c:3"]);
  assert.throws(() => splitAddresses(" , "), /no coordinator address/);
  const client = new CoordinatorClient(["a:1,b:2", "c:3"]);
  try {
    assert.deepEqual(client.addresses, ["a:1", "b:2", "c:3"]);
    assert.equal(client.address, "a:1,b:2,c:3");
    assert.equal(client.router.default, "a:1");
  } finally {
    client.close();
  }
  const one = new CoordinatorClient("a:1");
  assert.equal(one.address, "a:1");
  one.close();
});

test("the router keeps a bounded memory of owners", () => {
  const router = new ShardRouter(["a:1", "b:2"], { ownersKept: 2 });
  router.learn("q1", "b:2");
  router.learn("q2", "b:2");
  router.learn("q3", "a:1");
  assert.deepEqual([router.owner("q1"), router.owner("q2"), router.owner("q3")], [undefined, "b:2", "a:1"]);
  router.wentAway("b:2");
  assert.equal(router.owner("q2"), undefined);
  assert.equal(router.default, "a:1");
  router.wentAway("a:1");
  assert.equal(router.default, "b:2");
  assert.deepEqual(router.candidates(), ["b:2", "a:1"]);
});

test("a coordinator that answers UNAVAILABLE stays the default", () => {
  const router = new ShardRouter(["a:1", "b:2", "c:3"]);
  const route = router.route("q");
  const takeover = "shard 1 (hf:{s1}:) has no coordinator now";
  const answered = toCoordinatorError(serviceError(status.UNAVAILABLE, takeover), "a:1", true);
  assert.ok(answered instanceof CoordinatorUnavailableError && answered.answered);
  assert.equal(answered.message, `coordinator at a:1: UNAVAILABLE: ${takeover}`);
  assert.equal(route.reroute(answered, undefined), undefined);
  assert.deepEqual([route.address, router.default], ["b:2", "a:1"]); // it runs: ask it first still
  router.learn("q", "b:2");
  const refused = toCoordinatorError(serviceError(status.UNAVAILABLE, "connection refused"), "b:2");
  assert.ok(refused instanceof CoordinatorUnavailableError && !refused.answered);
  assert.equal(route.reroute(refused, undefined), undefined);
  assert.deepEqual([route.address, router.owner("q")], ["c:3", undefined]); // gone: forgotten as owner
  const none = route.reroute(refused, undefined);
  assert.ok(none instanceof CoordinatorUnavailableError);
  assert.equal(none.address, "a:1,b:2,c:3");
  assert.ok(
    none.message.startsWith(`no coordinator can serve query 'q' now (a:1: ${takeover}; b:2: no answer; c:3: no answer)`),
    none.message,
  );
  // One address: its own error, unchanged.
  assert.equal(new ShardRouter(["a:1"]).route("q").reroute(refused, undefined), refused);
});

test("a redirect is followed and remembered, and a circle is ShardRedirectLoopError", () => {
  const router = new ShardRouter(["a:1", "b:2"]);
  const route = router.route("q");
  const first = redirect("q", "b:2");
  assert.equal(ownerOf(first), "b:2");
  assert.equal(ownerOf(new Error("x")), undefined);
  assert.equal(route.reroute(first, ownerOf(first)), undefined);
  assert.deepEqual([route.address, router.owner("q"), router.route("q").address], ["b:2", "b:2", "b:2"]);
  const loop = route.reroute(redirect("q", "a:1"), "a:1");
  assert.ok(loop instanceof ShardRedirectLoopError, String(loop));
  assert.deepEqual(loop.hops, ["a:1", "b:2", "a:1"]);
  assert.equal(loop.code, StatusCode.FAILED_PRECONDITION);
  assert.ok(
    loop.message.startsWith(
      "query 'q': the coordinators keep redirecting it (a:1 -> b:2 -> a:1); do they all run with the same --shards? " +
        "Last answer: query 'q' belongs to shard 1",
    ),
    loop.message,
  );
  // A call not about a query follows no redirect.
  const unrouted = redirect("q", "b:2");
  assert.equal(router.route(undefined).reroute(unrouted, "b:2"), unrouted);
  // A chain, no circle: it stops after MAX_REDIRECTS hops.
  const chain = new ShardRouter(["s0"]).route("q");
  let problem: CoordinatorError | undefined;
  for (let k = 1; problem === undefined; k++) problem = chain.reroute(redirect("q", `s${k}`), `s${k}`);
  assert.ok(problem instanceof ShardRedirectLoopError);
  assert.equal(problem.hops.length, MAX_REDIRECTS + 2);
});
