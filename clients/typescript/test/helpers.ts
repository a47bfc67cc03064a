// Helpers the live test files share (live, shards): not a test file itself, so node --test
// (dist/test/*.test.js) does not run it.
import assert from "node:assert/strict";

import { CoordinatorError } from "../src/index.js";

/** Every item of `iterable`, once it ends. */
export async function collect<T>(iterable: AsyncIterable<T>): Promise<T[]> {
  const items: T[] = [];
  for await (const item of iterable) items.push(item);
  return items;
}

/** The CoordinatorError `promise` rejects with; fails the test if it resolves. */
export async function rejection(promise: Promise<unknown>): Promise<CoordinatorError> {
  try {
    await promise;
  } catch (error) {
    assert.ok(error instanceof CoordinatorError, `expected a CoordinatorError, got ${String(error)}`);
    return error;
  }
  assert.fail("expected the call to fail");
}
