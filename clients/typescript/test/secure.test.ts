// Live tests against a secured coordinator (`hexgen-flow up --secure --auth-dir DIR
// --tenants a,b`): TLS only, with a certificate signed by DIR/ca.pem, and an API key on every
// call. HEXGEN_COORDINATOR_SECURE=HOST:PORT and HEXGEN_COORDINATOR_SECURE_AUTH_DIR=DIR (ca.pem,
// tenants/a.key, tenants/b.key; scripts/test_clients.py starts such a mesh); without them the
// tests are skipped.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { after, describe, test as nodeTest } from "node:test";

import {
  API_KEY_ENV,
  CoordinatorClient,
  CoordinatorError,
  QueryEventKind,
  StatusCode,
  TLS_CA_ENV,
  type CoordinatorClientOptions,
} from "../src/index.js";

const address = process.env["HEXGEN_COORDINATOR_SECURE"];
const authDir = process.env["HEXGEN_COORDINATOR_SECURE_AUTH_DIR"];
const skip =
  address && authDir
    ? false
    : "HEXGEN_COORDINATOR_SECURE and HEXGEN_COORDINATOR_SECURE_AUTH_DIR are not set (a secured coordinator)";
const test = (name: string, fn: () => Promise<void>) => nodeTest(name, { skip, timeout: 60_000 }, fn);

const ca = authDir ? join(authDir, "ca.pem") : "";
const key = (tenant: string) => (authDir ? readFileSync(join(authDir, "tenants", `${tenant}.key`), "utf8").trim() : "");
const queryId = `ts-secure-${Date.now().toString(36)}-${process.pid}`;

async function code(promise: Promise<unknown>): Promise<number> {
  try {
    await promise;
  } catch (error) {
    assert.ok(error instanceof CoordinatorError, `expected a CoordinatorError, got ${String(error)}`);
    return error.code;
  }
  assert.fail("expected the call to fail");
}

describe("secured coordinator (TLS, API keys, tenants a and b)", () => {
  const clients: CoordinatorClient[] = [];
  const connect = (options: CoordinatorClientOptions) => {
    const client = new CoordinatorClient(address, { timeoutMs: 20_000, ...options });
    clients.push(client);
    return client;
  };
  after(() => clients.forEach((client) => client.close()));

  test("tenant a runs a query and reads it back (key and CA from the environment)", async () => {
    const saved = { key: process.env[API_KEY_ENV], ca: process.env[TLS_CA_ENV] };
    process.env[API_KEY_ENV] = key("a");
    process.env[TLS_CA_ENV] = ca;
    let client: CoordinatorClient;
    try {
      client = connect({});
    } finally {
      for (const [name, value] of [
        [API_KEY_ENV, saved.key],
        [TLS_CA_ENV, saved.ca],
      ] as const) {
        if (value === undefined) delete process.env[name];
        else process.env[name] = value;
      }
    }
    const workflow = {
      stages: [
        { id: "plan", step: "extract_keywords", calls: [{ inputTokens: 300, outputTokens: 16 }] },
        { id: "pick", step: "evaluate", after: ["plan"], calls: [{ inputTokens: 400, outputTokens: 8 }] },
      ],
    };
    const events = [];
    for await (const event of client.run({ queryId, workflow, sloScale: 5 })) events.push(event);
    assert.equal(events.at(-1)?.kind, QueryEventKind.QUERY_EVENT_KIND_SUCCEEDED);

    const byOptions = connect({ apiKey: key("a"), tlsCa: ca });
    const info = (await byOptions.get(queryId)).query;
    assert.equal(info?.queryId, queryId);
    assert.equal(info?.callsDone, 2);
  });

  test("no key: UNAUTHENTICATED", async () => {
    const anonymous = connect({ apiKey: "", tlsCa: ca });
    assert.equal(await code(anonymous.status()), StatusCode.UNAUTHENTICATED);
    assert.equal(await code(anonymous.get(queryId)), StatusCode.UNAUTHENTICATED);
  });

  test("tenant b does not see tenant a's query: NOT_FOUND", async () => {
    const b = connect({ apiKey: key("b"), tlsCa: ca });
    assert.equal(await code(b.get(queryId)), StatusCode.NOT_FOUND);
    const a = connect({ apiKey: key("a"), tlsCa: ca });
    assert.equal(await code(a.get(queryId, { apiKey: key("b") })), StatusCode.NOT_FOUND, "b's key for one call");
  });

  test("a tenant may not set alpha: PERMISSION_DENIED", async () => {
    const a = connect({ apiKey: key("a"), tlsCa: ca });
    assert.equal(await code(a.setAlpha(0.5, "ts client test")), StatusCode.PERMISSION_DENIED);
  });

  test("plaintext against the TLS port fails", async () => {
    const plain = connect({ apiKey: key("a"), tlsCa: "", timeoutMs: 5_000 });
    const got = await code(plain.status());
    assert.notEqual(got, StatusCode.OK);
  });
});
