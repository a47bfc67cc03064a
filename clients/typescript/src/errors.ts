// Errors of the client: every failed RPC becomes a CoordinatorError (or a subclass).
import { Metadata, status, type ServiceError } from "@grpc/grpc-js";

/** The trailer a RESOURCE_EXHAUSTED refusal carries: wall seconds to wait before retrying. */
export const RETRY_AFTER_KEY = "retry-after-s";

/** The gRPC status codes by name (`status.INVALID_ARGUMENT` is 3), re-exported for callers. */
export { status as StatusCode };

/** The name of a gRPC status code ("INVALID_ARGUMENT"), or its number as a string. */
export function statusName(code: number): string {
  return (status as unknown as Record<number, string>)[code] ?? String(code);
}

/** The coordinator (or grpc, for a connection that failed) answered an RPC with an error. */
export class CoordinatorError extends Error {
  /** The coordinator's address. */
  readonly address: string;
  /** The gRPC status code (`StatusCode.INVALID_ARGUMENT`, ...). */
  readonly code: status;
  /** The status code's name, e.g. "INVALID_ARGUMENT". */
  readonly codeName: string;
  /** The server's (or grpc's) one-line description, e.g. "workflow.stages: must not be empty". */
  readonly details: string;
  /** The trailing metadata that came with the status. */
  readonly metadata: Metadata;
  /** RESOURCE_EXHAUSTED: the `retry-after-s` trailer (wall seconds); undefined without one. */
  readonly retryAfterS: number | undefined;

  constructor(
    address: string,
    code: status,
    details: string,
    metadata: Metadata = new Metadata(),
    message?: string,
  ) {
    super(message ?? `coordinator at ${address}: ${statusName(code)}: ${details}`);
    this.name = new.target.name;
    this.address = address;
    this.code = code;
    this.codeName = statusName(code);
    this.details = details;
    this.metadata = metadata;
    this.retryAfterS = retryAfter(metadata);
  }

  /**
   * The field the details name: the coordinator writes them as "<field path>: <why>"
   * ("workflow.stages[0].calls[0].output_tokens: must be in [1, 10000000], got -1",
   * "query_id: no query 'q-9'"); undefined when they do not start with a field path.
   */
  get field(): string | undefined {
    const match = /^([A-Za-z_][\w.\[\]]*): /.exec(this.details);
    return match?.[1];
  }
}

/** Nothing answers at the address, or the coordinator answered UNAVAILABLE (its Redis is
 * away, or, sharded, the query's shard has no coordinator during a takeover): worth retrying.
 * With several coordinators and none that could serve, `address` lists those tried. */
export class CoordinatorUnavailableError extends CoordinatorError {
  /** Whether the coordinator itself answered UNAVAILABLE (it runs, but cannot serve this
   * now), rather than nothing answering at its address. */
  readonly answered: boolean;

  constructor(
    address: string,
    code: status,
    details: string,
    metadata: Metadata = new Metadata(),
    message?: string,
    answered = false,
  ) {
    super(address, code, details, metadata, message);
    this.answered = answered || details.startsWith("redis unavailable");
  }
}

/** Coordinators redirected a query's RPC in a circle, or further than a client follows
 * (`MAX_REDIRECTS`): they disagree on who owns its shard (not the same `--shards`, or a stale
 * lease). FAILED_PRECONDITION; `hops` names the path. */
export class ShardRedirectLoopError extends CoordinatorError {
  /** The query the RPC was about. */
  readonly queryId: string;
  /** The addresses it was sent to, in order, then the owner the last one named. */
  readonly hops: readonly string[];

  constructor(queryId: string, hops: readonly string[], details: string, metadata: Metadata = new Metadata()) {
    super(
      hops.at(-1) ?? "",
      status.FAILED_PRECONDITION,
      details,
      metadata,
      `query '${queryId}': the coordinators keep redirecting it (${hops.join(" -> ")}); ` +
        `do they all run with the same --shards? Last answer: ${details}`,
    );
    this.queryId = queryId;
    this.hops = [...hops];
  }
}

/** The coordinator refused a submission (RESOURCE_EXHAUSTED: admission control, or a limit
 * on running queries); `retryAfterS` is its hint. */
export class CoordinatorOverloadedError extends CoordinatorError {}

function retryAfter(metadata: Metadata): number | undefined {
  const values = metadata.get(RETRY_AFTER_KEY);
  if (values.length === 0) return undefined;
  const value = Number(String(values[0]));
  return Number.isFinite(value) ? value : undefined;
}

function isServiceError(error: unknown): error is ServiceError {
  return (
    error instanceof Error &&
    typeof (error as Partial<ServiceError>).code === "number" &&
    "details" in error
  );
}

/** The CoordinatorError for what a grpc-js call failed with (other errors pass through).
 * `answered`: an UNAVAILABLE came through a connected channel, from the coordinator itself. */
export function toCoordinatorError(error: unknown, address: string, answered = false): unknown {
  if (error instanceof CoordinatorError || !isServiceError(error)) return error;
  const metadata = error.metadata ?? new Metadata();
  const details = error.details ?? "";
  switch (error.code) {
    case status.UNAVAILABLE:
      return new CoordinatorUnavailableError(
        address,
        error.code,
        details,
        metadata,
        answered || details.startsWith("redis unavailable")
          ? `coordinator at ${address}: UNAVAILABLE: ${details}`
          : `cannot reach the coordinator at ${address} (is \`hexgen-flow up\` running?): ${details}`,
        answered,
      );
    case status.RESOURCE_EXHAUSTED:
      return new CoordinatorOverloadedError(address, error.code, details, metadata);
    default:
      return new CoordinatorError(address, error.code, details, metadata);
  }
}
