// Live tests against running coordinators. HEXGEN_COORDINATOR=HOST:PORT: a mesh (e.g. what
// `hexgen-flow up --listen 127.0.0.1:0 --no-tuner --no-gateway --time-scale 50` prints).
// HEXGEN_COORDINATOR_LIMITED=HOST:PORT: a coordinator started with `--max-running-queries 1
// --admission off` and no worker (scripts/test_clients.py starts one), where the query these
// tests submit stays running: the next submission is RESOURCE_EXHAUSTED with a retry-after-s
// trailer, and a watch of it never ends by itself. Without them, their tests are skipped.
import assert from "node:assert/strict";
import { after, before, describe, test as nodeTest } from "node:test";

import {
  CoordinatorClient,
  CoordinatorOverloadedError,
  QueryEventKind,
  QueryState,
  StatusCode,
  eventKindName,
  isTerminal,
  type QueryEvent,
  type RunCallResponse,
  type SubmitQueryRequest,
  type DeepPartial,
} from "../src/index.js";
import { collect, rejection } from "./helpers.js";

const address = process.env["HEXGEN_COORDINATOR"];
const skip = address ? false : "HEXGEN_COORDINATOR is not set (HOST:PORT of a running coordinator)";
const limitedAddress = process.env["HEXGEN_COORDINATOR_LIMITED"];
const skipLimited = limitedAddress
  ? false
  : "HEXGEN_COORDINATOR_LIMITED is not set (HOST:PORT of a coordinator with --max-running-queries 1)";
const TIMEOUT_MS = 120_000;
const run = `${Date.now().toString(36)}-${process.pid}`;
let counter = 0;
const newId = (what: string) => `ts-test-${what}-${run}-${counter++}`;

/** A three-stage workflow: one call, a fan-out of two, one call. */
function smallWorkflow(outputTokens = 24): DeepPartial<SubmitQueryRequest>["workflow"] {
  return {
    stages: [
      { id: "plan", step: "extract_keywords", calls: [{ inputTokens: 300, outputTokens }] },
      {
        id: "draft",
        step: "generate_candidate",
        after: ["plan"],
        calls: [
          { inputTokens: 600, outputTokens },
          { inputTokens: 600, outputTokens },
        ],
      },
      { id: "pick", step: "evaluate", after: ["draft"], calls: [{ inputTokens: 400, outputTokens: 8 }] },
    ],
  };
}

const kinds = (events: QueryEvent[]) => events.map((event) => eventKindName(event.kind));

/** A test of the suite: skipped (and counted as such) without HEXGEN_COORDINATOR. */
const test = (name: string, fn: () => Promise<void>) => nodeTest(name, { skip, timeout: TIMEOUT_MS }, fn);
/** A test against the limited coordinator: skipped without HEXGEN_COORDINATOR_LIMITED. */
const limitedTest = (name: string, fn: () => Promise<void>) =>
  nodeTest(name, { skip: skipLimited, timeout: TIMEOUT_MS }, fn);

describe("live coordinator", () => {
  let client: CoordinatorClient;

  before(async () => {
    if (!address) return;
    client = new CoordinatorClient(address);
    await client.waitForReady(10_000);
  });
  after(() => client?.close());

  test("cluster status", async () => {
    const status = await client.status();
    assert.ok(status.instances.length > 0, "no instances");
    assert.ok(status.instances.every((instance) => instance.name !== "" && instance.gpu !== ""));
    assert.ok(status.instances.some((instance) => instance.connected), "no worker connected");
    assert.notEqual(status.policy, "");
    assert.ok(status.timeScale > 0);
    assert.ok(status.nowS > 0);
    assert.equal(status.cluster.split(",").length, status.instances.length);
  });

  test("submit, then watch to the end", async () => {
    const queryId = newId("submit");
    const submitted = await client.submit({ queryId, workflow: smallWorkflow() });
    assert.equal(submitted.created, true);
    assert.equal(submitted.query?.queryId, queryId);
    assert.equal(submitted.query?.stagesTotal, 3);
    assert.equal(submitted.query?.callsTotal, 4);

    const again = await client.submit({ queryId, workflow: smallWorkflow() });
    assert.equal(again.created, false, "submission is idempotent on the query id");

    const events = await collect(client.watch(queryId));
    assert.equal(events[0]?.kind, QueryEventKind.QUERY_EVENT_KIND_SUBMITTED);
    assert.equal(events.at(-1)?.kind, QueryEventKind.QUERY_EVENT_KIND_SUCCEEDED);
    assert.deepEqual(
      events.map((event) => event.sequence),
      events.map((_, index) => index),
      "the log is replayed from its start, in order",
    );
    assert.ok(events.every((event) => event.queryId === queryId));
    const finished = events.filter((event) => event.kind === QueryEventKind.QUERY_EVENT_KIND_CALL_FINISHED);
    assert.equal(finished.length, 4);
    assert.ok(finished.every((event) => event.instance !== "" && event.callId.startsWith(`${queryId}/`)));

    // Watching an ended query replays its log and ends.
    const replayed = await collect(client.watch(queryId));
    assert.deepEqual(kinds(replayed), kinds(events));
  });

  test("run streams a query to its end, and get reports it", async () => {
    const queryId = newId("run");
    const events = await collect(
      client.run({ queryId, workflow: smallWorkflow(), sloScale: 3 }, { traceparent: traceparent() }),
    );
    const names = kinds(events);
    assert.equal(names[0], "SUBMITTED");
    assert.equal(names.at(-1), "SUCCEEDED");
    for (const kind of ["STAGE_RELEASED", "CALL_DISPATCHED", "CALL_STARTED", "CALL_FINISHED", "STAGE_FINISHED"]) {
      assert.ok(names.includes(kind), `no ${kind} in ${names.join(",")}`);
    }

    const got = await client.get(queryId);
    const info = got.query;
    assert.ok(info);
    assert.equal(info.state, QueryState.QUERY_STATE_SUCCEEDED);
    assert.equal(info.stagesDone, 3);
    assert.equal(info.callsDone, 4);
    assert.ok(info.finishedS >= info.arrivalS && info.arrivalS > 0);
    assert.ok(info.sloS > 0 && info.deadlineS > info.arrivalS);
    assert.equal(info.session, false);
    assert.deepEqual(kinds(got.events), names);
    assert.deepEqual(
      got.stages.map((stage) => [stage.index, stage.name, stage.step, stage.callsTotal, stage.callsDone]),
      [
        [0, "plan", "extract_keywords", 1, 1],
        [1, "draft", "generate_candidate", 2, 2],
        [2, "pick", "evaluate", 1, 1],
      ],
    );
    assert.deepEqual(got.stages[1]?.after, [0]);
    assert.deepEqual(got.stages[2]?.after, [1]);
  });

  test("cancel a running query", async () => {
    const queryId = newId("cancel");
    // Long calls: at any time scale they are still running when the cancel arrives (with
    // an SLO they can meet: admission refuses for good a query no idle cluster serves in time).
    await client.submit({ queryId, workflow: smallWorkflow(100_000), sloS: 86_400 });
    const cancelled = await client.cancel(queryId);
    assert.equal(cancelled.query?.state, QueryState.QUERY_STATE_CANCELLED);

    const events = await collect(client.watch(queryId));
    assert.equal(events.at(-1)?.kind, QueryEventKind.QUERY_EVENT_KIND_CANCELLED);
    const got = await client.get(queryId);
    assert.equal(got.query?.state, QueryState.QUERY_STATE_CANCELLED);
    assert.ok((got.query?.callsDone ?? 0) < 4);
  });

  test("a bad request is INVALID_ARGUMENT naming the field", async () => {
    const badTokens = await rejection(
      client.submit({
        queryId: newId("bad"),
        workflow: { stages: [{ id: "a", step: "chat", calls: [{ inputTokens: 10, outputTokens: -1 }] }] },
      }),
    );
    assert.equal(badTokens.code, StatusCode.INVALID_ARGUMENT);
    assert.equal(badTokens.codeName, "INVALID_ARGUMENT");
    assert.match(badTokens.details, /^workflow\.stages\[0\]\.calls\[0\]\.output_tokens: /);
    assert.equal(badTokens.field, "workflow.stages[0].calls[0].output_tokens");

    const noStages = await rejection(client.submit({ queryId: newId("bad"), workflow: { stages: [] } }));
    assert.equal(noStages.code, StatusCode.INVALID_ARGUMENT);
    assert.equal(noStages.field, "workflow.stages");

    // In a stream the error is thrown by the iterator; RunQuery prefixes the field.
    const inStream = await rejection(collect(client.run({ queryId: "", workflow: smallWorkflow() })));
    assert.equal(inStream.code, StatusCode.INVALID_ARGUMENT);
    assert.equal(inStream.field, "query.query_id");
  });

  test("an unknown id is NOT_FOUND", async () => {
    const unknown = newId("unknown");
    for (const attempt of [
      () => client.get(unknown),
      () => client.cancel(unknown),
      () => client.closeWorkflow(unknown),
      () => collect(client.watch(unknown)),
      () => collect(client.runCall(unknown, "chat", "hello")),
    ]) {
      const error = await rejection(attempt());
      assert.equal(error.code, StatusCode.NOT_FOUND, error.message);
      assert.ok(error.details.includes(unknown), error.details);
    }
  });

  test("a workflow session: open, two calls, close, the stages in get", async () => {
    const workflowId = newId("session");
    const opened = await client.openWorkflow({ workflowId, template: "chess", sloScale: 3 });
    assert.equal(opened.created, true);
    assert.equal(opened.workflow?.session, true);
    assert.equal(opened.workflow?.sessionOpen, true);
    const reopened = await client.openWorkflow({ workflowId, template: "chess", sloScale: 3 });
    assert.equal(reopened.created, false);

    const first = await collect(
      client.runCall(workflowId, "extract_keywords", { prompt: "Which players won in 2024?", outputTokens: 16 }),
    );
    checkCall(first, workflowId);
    const second = await collect(
      client.runCall(
        workflowId,
        "information_retriever",
        {
          messages: [
            { role: "system", content: "Link the question to the schema." },
            { role: "user", content: "keywords: players, 2024" },
          ],
          outputTokens: 24,
        },
        { traceparent: traceparent() },
      ),
    );
    checkCall(second, workflowId);
    assert.notEqual(first[0]?.callId, second[0]?.callId);

    // Bad input to a session is INVALID_ARGUMENT naming the field, too.
    const emptyStage = await rejection(collect(client.runCall(workflowId, "", "hello")));
    assert.equal(emptyStage.code, StatusCode.INVALID_ARGUMENT);
    assert.equal(emptyStage.field, "stage");

    const closed = await client.closeWorkflow(workflowId);
    assert.equal(closed.workflow?.sessionOpen, false);
    const events = await collect(client.watch(workflowId));
    const names = kinds(events);
    assert.equal(names.at(-1), "SUCCEEDED");
    assert.ok(names.includes("CLOSED"), names.join(","));
    assert.ok(names.includes("CALL_SKIPPED"), names.join(","));
    assert.equal(names.filter((name) => name === "CALL_SUBMITTED").length, 2);

    // A closed session takes no more calls.
    const late = await rejection(collect(client.runCall(workflowId, "evaluate", "too late")));
    assert.equal(late.code, StatusCode.FAILED_PRECONDITION);

    const got = await client.get(workflowId);
    assert.equal(got.query?.state, QueryState.QUERY_STATE_SUCCEEDED);
    assert.equal(got.query?.session, true);
    const stages = got.stages;
    assert.deepEqual(
      stages.map((stage) => stage.name),
      ["extract_keywords", "information_retriever", "generate_candidate", "revise", "revise", "evaluate"],
    );
    assert.deepEqual(
      stages.map((stage) => [stage.callsGiven, stage.callsDone, stage.callsSkipped]),
      [
        [1, 1, 0],
        [1, 1, 0],
        [0, 3, 3],
        [0, 3, 3],
        [0, 3, 3],
        [0, 1, 1],
      ],
    );
    assert.ok(stages[0] && stages[0].releasedS > 0 && stages[0].finishedS >= stages[0].releasedS);
    assert.ok(stages.every((stage) => stage.deadlineS > 0));
  });

  test("leaving a stream early cancels it", async () => {
    const queryId = newId("early");
    for await (const event of client.run({ queryId, workflow: smallWorkflow(100_000), sloS: 86_400 })) {
      if (event.kind === QueryEventKind.QUERY_EVENT_KIND_SUBMITTED) break;
    }
    // The query goes on (only the stream ended); the client still works.
    const got = await client.get(queryId);
    assert.equal(got.query?.state, QueryState.QUERY_STATE_RUNNING);
    await client.cancel(queryId);
  });
});

describe("limited coordinator (one running query at a time, no worker)", () => {
  let client: CoordinatorClient;
  let running = ""; // a query that stays running until after() cancels it

  before(async () => {
    if (!limitedAddress) return;
    client = new CoordinatorClient(limitedAddress);
    await client.waitForReady(10_000);
    running = newId("running");
    const submitted = await client.submit({ queryId: running, workflow: smallWorkflow(), sloScale: 5 }).catch(
      (error: unknown) => {
        throw new Error(
          `the limited coordinator at ${limitedAddress} refused the tests' query (is its one slot held?): ${String(error)}`,
        );
      },
    );
    assert.equal(submitted.query?.state, QueryState.QUERY_STATE_RUNNING);
  });
  after(async () => {
    if (client && running) await client.cancel(running);
    client?.close();
  });

  limitedTest("a second submission is RESOURCE_EXHAUSTED with retryAfterS", async () => {
    const second = { queryId: newId("second"), workflow: smallWorkflow() };
    const refused = await rejection(client.submit(second));
    assert.ok(refused instanceof CoordinatorOverloadedError, refused.message);
    assert.equal(refused.code, StatusCode.RESOURCE_EXHAUSTED);
    assert.equal(refused.codeName, "RESOURCE_EXHAUSTED");
    assert.equal(refused.address, limitedAddress);
    assert.match(refused.details, /queries are running/);
    assert.ok(refused.retryAfterS !== undefined && refused.retryAfterS > 0, `retryAfterS ${refused.retryAfterS}`);
    assert.equal(Number(refused.metadata.get("retry-after-s")[0]), refused.retryAfterS);

    // In a stream the refusal is thrown by the iterator, with the stream's trailer.
    const inStream = await rejection(collect(client.run(second)));
    assert.ok(inStream instanceof CoordinatorOverloadedError, inStream.message);
    assert.ok((inStream.retryAfterS ?? 0) > 0, `retryAfterS ${inStream.retryAfterS}`);

    // Nothing was stored for the refused id.
    assert.equal((await rejection(client.get(second.queryId))).code, StatusCode.NOT_FOUND);
  });

  limitedTest("a watch past its deadline throws DEADLINE_EXCEEDED after the events before it", async () => {
    const events: QueryEvent[] = [];
    const error = await rejection(
      (async () => {
        for await (const event of client.watch(running, { timeoutMs: 1_000 })) events.push(event);
      })(),
    );
    assert.equal(error.code, StatusCode.DEADLINE_EXCEEDED, error.message);
    assert.equal(error.codeName, "DEADLINE_EXCEEDED");
    assert.equal(events[0]?.kind, QueryEventKind.QUERY_EVENT_KIND_SUBMITTED, kinds(events).join(","));
    assert.ok(events.every((event) => !isTerminal(event)), kinds(events).join(","));
    const got = await client.get(running);
    assert.equal(got.query?.state, QueryState.QUERY_STATE_RUNNING, "only the watch ended");
  });

  limitedTest("an abort signal cancels a stream and a unary call", async () => {
    const controller = new AbortController();
    const events: QueryEvent[] = [];
    const error = await rejection(
      (async () => {
        for await (const event of client.watch(running, { signal: controller.signal })) {
          events.push(event);
          setTimeout(() => controller.abort(), 50);
        }
      })(),
    );
    assert.equal(error.code, StatusCode.CANCELLED, error.message);
    assert.ok(events.length >= 1);

    const aborted = new AbortController();
    aborted.abort();
    const unary = await rejection(client.status({ signal: aborted.signal }));
    assert.equal(unary.code, StatusCode.CANCELLED, unary.message);
  });

  limitedTest("leaving a watch early cancels the stream, not the query", async () => {
    for await (const event of client.watch(running)) {
      assert.equal(event.kind, QueryEventKind.QUERY_EVENT_KIND_SUBMITTED);
      break;
    }
    const got = await client.get(running);
    assert.equal(got.query?.state, QueryState.QUERY_STATE_RUNNING);
  });

  limitedTest("once the running query ends, a submission is admitted again", async () => {
    const cancelled = await client.cancel(running);
    assert.equal(cancelled.query?.state, QueryState.QUERY_STATE_CANCELLED);
    const next = newId("next");
    const admitted = await client.submit({ queryId: next, workflow: smallWorkflow(), sloScale: 5 });
    assert.equal(admitted.created, true);
    running = next; // after() cancels it
  });
});

/** The responses of one RunCall: the first names the call, the last is its CALL_FINISHED. */
function checkCall(responses: RunCallResponse[], workflowId: string): void {
  const callId = responses[0]?.callId ?? "";
  assert.ok(callId.startsWith(`${workflowId}/`), `call id ${callId}`);
  assert.ok((responses[0]?.deadlineS ?? 0) > 0);
  const last = responses.at(-1)?.event;
  assert.equal(last?.kind, QueryEventKind.QUERY_EVENT_KIND_CALL_FINISHED);
  assert.equal(last?.callId, callId);
  assert.notEqual(last?.text, "");
  assert.ok(responses.slice(1).every((response) => response.callId === ""));
}

function traceparent(): string {
  const hex = (bytes: number) =>
    Array.from({ length: bytes }, () => Math.floor(Math.random() * 256).toString(16).padStart(2, "0")).join("");
  return `00-${hex(16)}-${hex(8)}-01`;
}
