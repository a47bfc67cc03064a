// Offline tests against an in-process fake coordinator (the generated service definition on a
// grpc-js server): metadata, error mapping, trailers and stream endings. No mesh needed.
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import {
  Metadata,
  Server,
  ServerCredentials,
  status,
  type sendUnaryData,
  type ServerUnaryCall,
  type ServerWritableStream,
  type UntypedServiceImplementation,
} from "@grpc/grpc-js";

import {
  CoordinatorClient,
  CoordinatorError,
  CoordinatorOverloadedError,
  CoordinatorServiceService,
  CoordinatorUnavailableError,
  QueryEvent,
  QueryEventKind,
  QueryState,
  StatusCode,
  type ClusterStatusRequest,
  ClusterStatusResponse,
  type RunCallRequest,
  type RunCallResponse,
  type RunQueryRequest,
  type RunQueryResponse,
  type SubmitQueryRequest,
  SubmitQueryResponse,
  type WatchQueryRequest,
  type WatchQueryResponse,
} from "../src/index.js";

const K = QueryEventKind;
const event = (kind: QueryEventKind, extra: Partial<QueryEvent> = {}): QueryEvent =>
  QueryEvent.fromPartial({ queryId: "q", kind, stage: -1, ...extra });

function fail(code: status, details: string, trailers?: Record<string, string>) {
  const metadata = new Metadata();
  for (const [key, value] of Object.entries(trailers ?? {})) metadata.set(key, value);
  return Object.assign(new Error(details), { code, details, metadata });
}

describe("fake coordinator", () => {
  const server = new Server();
  let client: CoordinatorClient;
  let address = "";
  const seen: Metadata[] = [];
  let runCallCancelled: Promise<void> = Promise.resolve();

  const implementation: UntypedServiceImplementation = {
    clusterStatus(
      call: ServerUnaryCall<ClusterStatusRequest, ClusterStatusResponse>,
      callback: sendUnaryData<ClusterStatusResponse>,
    ) {
      seen.push(call.metadata);
      if (call.metadata.get("slow").length > 0) return; // never answers: deadlines and aborts
      callback(null, ClusterStatusResponse.fromPartial({ policy: "fake", alpha: 0.5, timeScale: 1, nowS: 1 }));
    },
    submitQuery(
      call: ServerUnaryCall<SubmitQueryRequest, SubmitQueryResponse>,
      callback: sendUnaryData<SubmitQueryResponse>,
    ) {
      const id = call.request.queryId;
      if (id === "overloaded") {
        callback(fail(status.RESOURCE_EXHAUSTED, "admission: predicted 90.0 s > 1.2 x SLO", { "retry-after-s": "1.250" }));
      } else if (id === "redis") {
        callback(fail(status.UNAVAILABLE, "redis unavailable: connection refused, retry"));
      } else if (id === "") {
        callback(fail(status.INVALID_ARGUMENT, "query_id: must not be empty (it is the idempotency key)"));
      } else {
        const stages = call.request.workflow?.stages.length ?? 0;
        callback(
          null,
          SubmitQueryResponse.fromPartial({
            created: true,
            query: { queryId: id, state: QueryState.QUERY_STATE_RUNNING, stagesTotal: stages },
          }),
        );
      }
    },
    watchQuery(call: ServerWritableStream<WatchQueryRequest, WatchQueryResponse>) {
      seen.push(call.metadata);
      call.write({ event: event(K.QUERY_EVENT_KIND_SUBMITTED, { sequence: 0 }) });
      call.write({ event: event(K.QUERY_EVENT_KIND_FAILED, { sequence: 1, text: "boom" }) });
      call.write({ event: event(K.QUERY_EVENT_KIND_CLOSED, { sequence: 2 }) }); // after the end
      call.end();
    },
    runQuery(call: ServerWritableStream<RunQueryRequest, RunQueryResponse>) {
      call.write({ event: event(K.QUERY_EVENT_KIND_SUBMITTED, { queryId: call.request.query?.queryId ?? "" }) });
      call.emit("error", fail(status.UNAVAILABLE, "redis unavailable: gone, retry"));
    },
    runCall(call: ServerWritableStream<RunCallRequest, RunCallResponse>) {
      seen.push(call.metadata);
      const id = `${call.request.workflowId}/0.0`;
      runCallCancelled = new Promise((resolve) => call.on("cancelled", () => resolve()));
      call.write({ callId: id, deadlineS: 42, event: event(K.QUERY_EVENT_KIND_CALL_SUBMITTED, { callId: id }) });
      call.write({ callId: "", deadlineS: 0, event: event(K.QUERY_EVENT_KIND_CALL_FINISHED, { callId: "other/1.0" }) });
      call.write({ callId: "", deadlineS: 0, event: event(K.QUERY_EVENT_KIND_CALL_FINISHED, { callId: id, text: call.request.call?.prompt ?? "" }) });
      // The stream stays open: the client stops at its call's CALL_FINISHED and cancels.
    },
  };

  before(async () => {
    server.addService(CoordinatorServiceService, implementation);
    const port = await new Promise<number>((resolve, reject) =>
      server.bindAsync("127.0.0.1:0", ServerCredentials.createInsecure(), (error, bound) =>
        error ? reject(error) : resolve(bound),
      ),
    );
    address = `127.0.0.1:${port}`;
    client = new CoordinatorClient(address, { metadata: { "x-client": "ts-test" } });
  });
  after(() => {
    client?.close();
    server.forceShutdown();
  });

  test("traceparent and metadata travel with a call", async () => {
    const traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    const status = await client.status({ traceparent, tracestate: "k=v", metadata: { "X-Extra": "1" } });
    assert.equal(status.policy, "fake");
    const metadata = seen.at(-1);
    assert.deepEqual(metadata?.get("traceparent"), [traceparent]);
    assert.deepEqual(metadata?.get("tracestate"), ["k=v"]);
    assert.deepEqual(metadata?.get("x-extra"), ["1"]);
    assert.deepEqual(metadata?.get("x-client"), ["ts-test"]);

    for await (const _ of client.watch("q", { traceparent })) {
      // drain
    }
    assert.deepEqual(seen.at(-1)?.get("traceparent"), [traceparent]);
    await client.status();
    assert.deepEqual(seen.at(-1)?.get("traceparent"), [], "no traceparent unless given");
  });

  test("RESOURCE_EXHAUSTED carries retry-after-s as retryAfterS", async () => {
    const error = await client.submit({ queryId: "overloaded" }).then(
      () => assert.fail("expected a refusal"),
      (error: unknown) => error,
    );
    assert.ok(error instanceof CoordinatorOverloadedError);
    assert.ok(error instanceof CoordinatorError);
    assert.equal(error.code, StatusCode.RESOURCE_EXHAUSTED);
    assert.equal(error.codeName, "RESOURCE_EXHAUSTED");
    assert.equal(error.retryAfterS, 1.25);
    assert.equal(error.address, address);
    assert.match(error.message, /RESOURCE_EXHAUSTED: admission/);
  });

  test("status codes and details become CoordinatorErrors", async () => {
    const invalid = await client.submit({ queryId: "" }).catch((error: unknown) => error);
    assert.ok(invalid instanceof CoordinatorError);
    assert.equal(invalid.code, StatusCode.INVALID_ARGUMENT);
    assert.equal(invalid.field, "query_id");
    assert.equal(invalid.retryAfterS, undefined);

    const redis = await client.submit({ queryId: "redis" }).catch((error: unknown) => error);
    assert.ok(redis instanceof CoordinatorUnavailableError);
    assert.match(redis.message, /UNAVAILABLE: redis unavailable/);

    const created = await client.submit({ queryId: "fine", workflow: { stages: [{ id: "a" }, { id: "b" }] } });
    assert.equal(created.query?.stagesTotal, 2);
  });

  test("watch ends with the terminal event", async () => {
    const events: QueryEvent[] = [];
    for await (const e of client.watch("q")) events.push(e);
    assert.deepEqual(
      events.map((e) => e.kind),
      [K.QUERY_EVENT_KIND_SUBMITTED, K.QUERY_EVENT_KIND_FAILED],
    );
  });

  test("an error in the middle of a stream is thrown by the iterator", async () => {
    const events: QueryEvent[] = [];
    const error = await (async () => {
      for await (const e of client.run({ queryId: "r" })) events.push(e);
    })().catch((error: unknown) => error);
    assert.equal(events.length, 1);
    assert.equal(events[0]?.queryId, "r");
    assert.ok(error instanceof CoordinatorUnavailableError, String(error));
  });

  test("runCall ends with its call's CALL_FINISHED and cancels the stream", async () => {
    const responses: RunCallResponse[] = [];
    for await (const response of client.runCall("w", "chat", "hello", { traceparent: "00-1-2-01" })) {
      responses.push(response);
    }
    assert.equal(responses.length, 3);
    assert.equal(responses[0]?.callId, "w/0.0");
    assert.equal(responses[0]?.deadlineS, 42);
    assert.equal(responses[2]?.event?.callId, "w/0.0");
    assert.equal(responses[2]?.event?.text, "hello");
    assert.deepEqual(seen.at(-1)?.get("traceparent"), ["00-1-2-01"]);
    await runCallCancelled; // the server saw the cancel
  });

  test("deadlines and aborts", async () => {
    const late = await client
      .status({ timeoutMs: 200, metadata: { slow: "1" } })
      .catch((error: unknown) => error);
    assert.ok(late instanceof CoordinatorError);
    assert.equal(late.code, StatusCode.DEADLINE_EXCEEDED);

    const controller = new AbortController();
    const pending = client.status({ signal: controller.signal, metadata: { slow: "1" } });
    setTimeout(() => controller.abort(), 50);
    const aborted = await pending.catch((error: unknown) => error);
    assert.ok(aborted instanceof CoordinatorError);
    assert.equal(aborted.code, StatusCode.CANCELLED);
  });
});

test("nothing listening is CoordinatorUnavailableError", async () => {
  const server = new Server();
  const port = await new Promise<number>((resolve, reject) =>
    server.bindAsync("127.0.0.1:0", ServerCredentials.createInsecure(), (error, bound) =>
      error ? reject(error) : resolve(bound),
    ),
  );
  server.forceShutdown(); // a port nobody listens on
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
