// A promise / async-iterator API over the generated @grpc/grpc-js stub of
// hexgen_flow.v1.CoordinatorService (src/gen/, `npm run generate`).
import { readFileSync } from "node:fs";

import {
  credentials as grpcCredentials,
  InterceptingCall,
  Metadata,
  status,
  type CallOptions as GrpcCallOptions,
  type ChannelCredentials,
  type ClientOptions,
  type ClientReadableStream,
  type ClientUnaryCall,
  type Interceptor,
  type ServiceError,
} from "@grpc/grpc-js";

import {
  CancelQueryRequest,
  type CancelQueryResponse,
  CloseWorkflowRequest,
  type CloseWorkflowResponse,
  ClusterStatusRequest,
  type ClusterStatusResponse,
  CoordinatorServiceClient,
  type DeepPartial,
  GetQueryRequest,
  type GetQueryResponse,
  OpenWorkflowRequest,
  type OpenWorkflowResponse,
  type QueryEvent,
  QueryEventKind,
  queryEventKindToJSON,
  RunCallRequest,
  type RunCallResponse,
  RunQueryRequest,
  SetAlphaRequest,
  type SetAlphaResponse,
  SubmitQueryRequest,
  type SubmitQueryResponse,
  WatchQueryRequest,
} from "./gen/hexgen_flow/v1/coordinator.js";
import type { LLMCall } from "./gen/hexgen_flow/v1/workflow.js";
import { CoordinatorUnavailableError, toCoordinatorError } from "./errors.js";

/** Where `hexgen-flow up` (and the Python client) put the coordinator by default. */
export const DEFAULT_COORDINATOR = "127.0.0.1:50051";

/** The events after which a query has ended: nothing follows them. */
export const TERMINAL_EVENT_KINDS: ReadonlySet<QueryEventKind> = new Set([
  QueryEventKind.QUERY_EVENT_KIND_SUCCEEDED,
  QueryEventKind.QUERY_EVENT_KIND_CANCELLED,
  QueryEventKind.QUERY_EVENT_KIND_FAILED,
]);

/** Whether an event ends its query (SUCCEEDED, CANCELLED or FAILED). */
export function isTerminal(event: QueryEvent): boolean {
  return TERMINAL_EVENT_KINDS.has(event.kind);
}

/** An event kind's short name: "CALL_FINISHED" for QUERY_EVENT_KIND_CALL_FINISHED. */
export function eventKindName(kind: QueryEventKind): string {
  return queryEventKindToJSON(kind).replace(/^QUERY_EVENT_KIND_/, "");
}

/** The metadata key the API key travels in, as `Bearer <key>`. */
export const API_KEY_METADATA = "authorization";
/** The environment variable the API key comes from when `apiKey` is not given. */
export const API_KEY_ENV = "HEXGEN_FLOW_API_KEY";
/** The environment variable naming the CA file (PEM) when `tlsCa` is not given. */
export const TLS_CA_ENV = "HEXGEN_FLOW_TLS_CA";

/**
 * A grpc-js client interceptor that sends `authorization: Bearer <key>` with every call
 * that does not carry an `authorization` of its own, over plaintext as over TLS (unlike
 * call credentials, which grpc-js sends over TLS only). `CoordinatorClient` installs one
 * for its `apiKey`; give it to any other grpc-js client of the mesh's services.
 */
export function apiKeyInterceptor(apiKey: string): Interceptor {
  const value = `Bearer ${apiKey}`;
  return (options, nextCall) =>
    new InterceptingCall(nextCall(options), {
      start(metadata, listener, next) {
        if (metadata.get(API_KEY_METADATA).length === 0) metadata.set(API_KEY_METADATA, value);
        next(metadata, listener);
      },
    });
}

export interface CoordinatorClientOptions {
  /** Channel credentials; default: TLS verified against `tlsCa` when there is one, else
   * plaintext (`credentials.createInsecure()`). Given, they win over `tlsCa`. */
  credentials?: ChannelCredentials;
  /** The API key of a secured coordinator (`hexgen-flow up --secure`), sent with every call
   * (the wrapped ones and the stub's) as `authorization: Bearer <key>`. Default:
   * `$HEXGEN_FLOW_API_KEY`; `""`: no key, whatever the environment says. */
  apiKey?: string;
  /** Path of the CA file (PEM; `up --secure`'s AUTH_DIR/ca.pem) the coordinator's certificate
   * is verified against: given, the channel is TLS (`credentials.createSsl`). Default:
   * `$HEXGEN_FLOW_TLS_CA`; `""` or neither: plaintext. */
  tlsCa?: string;
  /** grpc-js channel options ("grpc.keepalive_time_ms", ...). */
  channelOptions?: Partial<ClientOptions>;
  /** Deadline of each unary call, in milliseconds, unless the call gives its own; default
   * 30,000. 0: none. Streams have no deadline unless the call gives one. */
  timeoutMs?: number;
  /** Metadata sent with every call (the per-call `metadata` and `traceparent` win). */
  metadata?: Record<string, string>;
}

export interface CallOptions {
  /** A W3C trace context (`00-<trace id>-<span id>-<flags>`), sent as the `traceparent`
   * metadata: the coordinator's spans of this call become its children. */
  traceparent?: string;
  /** `tracestate`, sent with `traceparent`. */
  tracestate?: string;
  /** This call's deadline in milliseconds (0: none), instead of the client's `timeoutMs`. */
  timeoutMs?: number;
  /** More metadata for this call. */
  metadata?: Record<string, string>;
  /** This call's API key, instead of the client's (a server acting for several callers). */
  apiKey?: string;
  /** Cancels the call (a unary call rejects with CANCELLED, a stream ends with it). */
  signal?: AbortSignal;
}

/** The LLM call of `runCall`: its prompt alone, or the whole `LLMCall` (prompt or chat
 * `messages`, `inputTokens`, `outputTokens` = max tokens; 0: estimated / the expected
 * call's). */
export type CallInput = string | DeepPartial<LLMCall>;

/**
 * A client of the coordinator's API. Every failed call rejects (or, in a stream, throws)
 * with a `CoordinatorError` carrying the gRPC status code and details.
 *
 * ```ts
 * const client = new CoordinatorClient("127.0.0.1:50051");
 * for await (const event of client.run({ queryId: "q-1", workflow })) console.log(event);
 * client.close();
 * ```
 */
export class CoordinatorClient {
  readonly address: string;
  /** The generated grpc-js stub, for what this API does not wrap. */
  readonly stub: CoordinatorServiceClient;
  private readonly timeoutMs: number;
  private readonly metadata: Record<string, string>;

  constructor(address: string = DEFAULT_COORDINATOR, options: CoordinatorClientOptions = {}) {
    this.address = address;
    this.timeoutMs = options.timeoutMs ?? 30_000;
    this.metadata = { ...options.metadata };
    const apiKey = options.apiKey ?? process.env[API_KEY_ENV]?.trim() ?? "";
    const tlsCa = options.tlsCa ?? process.env[TLS_CA_ENV] ?? "";
    const channelOptions: Partial<ClientOptions> = { ...options.channelOptions };
    if (apiKey) channelOptions.interceptors = [...(channelOptions.interceptors ?? []), apiKeyInterceptor(apiKey)];
    this.stub = new CoordinatorServiceClient(
      address,
      options.credentials ??
        (tlsCa ? grpcCredentials.createSsl(readFileSync(tlsCa)) : grpcCredentials.createInsecure()),
      channelOptions,
    );
  }

  // ------------------------------------------------------------------------ queries

  /** Admit a query (idempotent on `queryId`: `created` is false when it was known). */
  submit(request: DeepPartial<SubmitQueryRequest>, options?: CallOptions): Promise<SubmitQueryResponse> {
    const message = SubmitQueryRequest.fromPartial(request);
    return this.unary(options, (md, opts, cb) => this.stub.submitQuery(message, md, opts, cb));
  }

  /** Cancel a query: its waiting calls are dropped, running ones aborted. */
  cancel(queryId: string, options?: CallOptions): Promise<CancelQueryResponse> {
    const message = CancelQueryRequest.fromPartial({ queryId });
    return this.unary(options, (md, opts, cb) => this.stub.cancelQuery(message, md, opts, cb));
  }

  /** A query's state, its events and its stages. */
  get(queryId: string, options?: CallOptions): Promise<GetQueryResponse> {
    const message = GetQueryRequest.fromPartial({ queryId });
    return this.unary(options, (md, opts, cb) => this.stub.getQuery(message, md, opts, cb));
  }

  /** The cluster: instances and their load, the policy, alpha, the clock. */
  status(options?: CallOptions): Promise<ClusterStatusResponse> {
    const message = ClusterStatusRequest.fromPartial({});
    return this.unary(options, (md, opts, cb) => this.stub.clusterStatus(message, md, opts, cb));
  }

  /** Set the dispatcher's alpha (what the tuner does); `reason` is kept in its history. */
  setAlpha(alpha: number, reason = "", options?: CallOptions): Promise<SetAlphaResponse> {
    const message = SetAlphaRequest.fromPartial({ alpha, reason });
    return this.unary(options, (md, opts, cb) => this.stub.setAlpha(message, md, opts, cb));
  }

  /** A query's events, past ones first, until its terminal one (SUCCEEDED, CANCELLED,
   * FAILED), which is the last yielded. */
  async *watch(queryId: string, options?: CallOptions): AsyncGenerator<QueryEvent, void, undefined> {
    const message = WatchQueryRequest.fromPartial({ queryId });
    const stream = this.stream(options, (md, opts) => this.stub.watchQuery(message, md, opts));
    for await (const response of stream) {
      if (response.event === undefined) continue;
      yield response.event;
      if (isTerminal(response.event)) return;
    }
  }

  /** Submit a query and stream its events until its terminal one (RunQuery). */
  async *run(
    request: DeepPartial<SubmitQueryRequest>,
    options?: CallOptions,
  ): AsyncGenerator<QueryEvent, void, undefined> {
    const message = RunQueryRequest.fromPartial({ query: request });
    const stream = this.stream(options, (md, opts) => this.stub.runQuery(message, md, opts));
    for await (const response of stream) {
      if (response.event === undefined) continue;
      yield response.event;
      if (isTerminal(response.event)) return;
    }
  }

  // ------------------------------------------------------------------------ sessions

  /** Open a workflow session (idempotent on `workflowId`; other content: ALREADY_EXISTS). */
  openWorkflow(
    request: DeepPartial<OpenWorkflowRequest>,
    options?: CallOptions,
  ): Promise<OpenWorkflowResponse> {
    const message = OpenWorkflowRequest.fromPartial(request);
    return this.unary(options, (md, opts, cb) => this.stub.openWorkflow(message, md, opts, cb));
  }

  /**
   * Give one call of an open session's `stage` and stream its responses: the first names the
   * call (`callId`) and its stage's deadline (`deadlineS`); the last carries the call's
   * CALL_FINISHED (or the query's terminal event, when it ends first).
   */
  async *runCall(
    workflowId: string,
    stage: string,
    call: CallInput,
    options?: CallOptions,
  ): AsyncGenerator<RunCallResponse, void, undefined> {
    const message = RunCallRequest.fromPartial({
      workflowId,
      stage,
      call: typeof call === "string" ? { prompt: call } : call,
    });
    const stream = this.stream(options, (md, opts) => this.stub.runCall(message, md, opts));
    let callId = "";
    for await (const response of stream) {
      if (response.callId) callId = response.callId;
      yield response;
      const event = response.event;
      if (event === undefined) continue;
      const finished =
        event.kind === QueryEventKind.QUERY_EVENT_KIND_CALL_FINISHED &&
        (callId === "" || event.callId === callId);
      if (finished || isTerminal(event)) return;
    }
  }

  /** Close a session: the calls it expected and was not given are skipped; it succeeds when
   * its last given call finishes. */
  closeWorkflow(workflowId: string, options?: CallOptions): Promise<CloseWorkflowResponse> {
    const message = CloseWorkflowRequest.fromPartial({ workflowId });
    return this.unary(options, (md, opts, cb) => this.stub.closeWorkflow(message, md, opts, cb));
  }

  // ------------------------------------------------------------------------ channel

  /** Resolve once the channel is connected; reject (UNAVAILABLE) after `timeoutMs`. */
  waitForReady(timeoutMs = 10_000): Promise<void> {
    return new Promise((resolve, reject) => {
      this.stub.waitForReady(Date.now() + timeoutMs, (error) => {
        if (error === undefined || error === null) resolve();
        else
          reject(
            new CoordinatorUnavailableError(
              this.address,
              status.UNAVAILABLE,
              error.message,
              new Metadata(),
              `cannot reach the coordinator at ${this.address} (is \`hexgen-flow up\` running?): ${error.message}`,
            ),
          );
      });
    });
  }

  /** Close the channel; calls in flight are cancelled. */
  close(): void {
    this.stub.close();
  }

  // ------------------------------------------------------------------------ plumbing

  private callMetadata(options: CallOptions | undefined): Metadata {
    const metadata = new Metadata();
    const entries: Record<string, string> = { ...this.metadata, ...options?.metadata };
    if (options?.traceparent) entries["traceparent"] = options.traceparent;
    if (options?.tracestate) entries["tracestate"] = options.tracestate;
    if (options?.apiKey) entries[API_KEY_METADATA] = `Bearer ${options.apiKey}`;
    for (const [key, value] of Object.entries(entries)) metadata.set(key.toLowerCase(), value);
    return metadata;
  }

  private callOptions(options: CallOptions | undefined, unary: boolean): Partial<GrpcCallOptions> {
    const timeoutMs = options?.timeoutMs ?? (unary ? this.timeoutMs : 0);
    return timeoutMs > 0 ? { deadline: Date.now() + timeoutMs } : {};
  }

  private unary<T>(
    options: CallOptions | undefined,
    start: (
      metadata: Metadata,
      callOptions: Partial<GrpcCallOptions>,
      callback: (error: ServiceError | null, response: T) => void,
    ) => ClientUnaryCall,
  ): Promise<T> {
    return new Promise<T>((resolve, reject) => {
      const signal = options?.signal;
      let call: ClientUnaryCall | undefined;
      const onAbort = () => call?.cancel();
      call = start(this.callMetadata(options), this.callOptions(options, true), (error, response) => {
        signal?.removeEventListener("abort", onAbort);
        if (error) reject(toCoordinatorError(error, this.address));
        else resolve(response);
      });
      if (signal?.aborted) call.cancel();
      else signal?.addEventListener("abort", onAbort, { once: true });
    });
  }

  private async *stream<T>(
    options: CallOptions | undefined,
    start: (metadata: Metadata, callOptions: Partial<GrpcCallOptions>) => ClientReadableStream<T>,
  ): AsyncGenerator<T, void, undefined> {
    const call = start(this.callMetadata(options), this.callOptions(options, false));
    // Cancelling a call makes it emit a CANCELLED error; nobody may be listening by then.
    call.on("error", () => {});
    const signal = options?.signal;
    const onAbort = () => call.cancel();
    if (signal?.aborted) call.cancel();
    else signal?.addEventListener("abort", onAbort, { once: true });
    try {
      for await (const response of call) yield response as T;
    } catch (error) {
      throw toCoordinatorError(error, this.address);
    } finally {
      signal?.removeEventListener("abort", onAbort);
      call.cancel(); // a no-op once the call has ended; stops the stream when left early
    }
  }
}
