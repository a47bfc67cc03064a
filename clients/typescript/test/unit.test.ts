// Unit tests that need no coordinator: the metadata a call sends, how a grpc-js error
// becomes a CoordinatorError (field, retry-after-s, subclasses), and an address where
// nothing listens. What the coordinator answers is tested live (live.test.ts).
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
  StatusCode,
  TLS_CA_ENV,
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
