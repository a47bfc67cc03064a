// A promise / async-iterator API over the generated @grpc/grpc-js stub of
// hexgen_flow.v1.CoordinatorService (src/gen/, `npm run generate`).
import { readFileSync } from "node:fs";

import {
  connectivityState,
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
import { CoordinatorError, CoordinatorUnavailableError, toCoordinatorError } from "./errors.js";
import { ownerOf, type Route, ShardRouter, splitAddresses } from "./routing.js";

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
 *
 * A sharded mesh's coordinators are given together, `"HOST:PORT,HOST:PORT"` or an array:
 * every call about a query goes where `router` says (the owner learnt from an earlier
 * redirect, else the default address), follows redirects (FAILED_PRECONDITION naming the
 * owner in the `hexgen-shard-owner` trailer; a circle is `ShardRedirectLoopError`) and moves
 * on past coordinators that do not answer (src/routing.ts). One channel per address used,
 * opened on first use.
 */
export class CoordinatorClient {
  /** The addresses as one string (the one address, without shards). */
  readonly address: string;
  /** The coordinators, in the order they are tried when one does not answer. */
  readonly addresses: readonly string[];
  /** Where each query's calls go: the owners learnt from redirects, the default address. */
  readonly router: ShardRouter;
  private readonly timeoutMs: number;
  private readonly metadata: Record<string, string>;
  private readonly credentials: ChannelCredentials;
  private readonly channelOptions: Partial<ClientOptions>;
  private readonly stubs = new Map<string, CoordinatorServiceClient>();

  constructor(address: string | readonly string[] = DEFAULT_COORDINATOR, options: CoordinatorClientOptions = {}) {
    this.addresses = splitAddresses(address);
    this.address = this.addresses.join(",");
    this.router = new ShardRouter(this.addresses);
    this.timeoutMs = options.timeoutMs ?? 30_000;
    this.metadata = { ...options.metadata };
    const apiKey = options.apiKey ?? process.env[API_KEY_ENV]?.trim() ?? "";
    const tlsCa = options.tlsCa ?? process.env[TLS_CA_ENV] ?? "";
    this.channelOptions = { ...options.channelOptions };
    if (apiKey)
      this.channelOptions.interceptors = [...(this.channelOptions.interceptors ?? []), apiKeyInterceptor(apiKey)];
    this.credentials =
      options.credentials ??
      (tlsCa ? grpcCredentials.createSsl(readFileSync(tlsCa)) : grpcCredentials.createInsecure());
  }

  /** The generated grpc-js stub of the default coordinator, for what this API does not wrap
   * (its calls are not routed: `ownerOf(error)` reads a redirect's owner). */
  get stub(): CoordinatorServiceClient {
    return this.stubAt(this.router.default);
  }

  private stubAt(address: string): CoordinatorServiceClient {
    let stub = this.stubs.get(address);
    if (stub === undefined) {
      stub = new CoordinatorServiceClient(address, this.credentials, this.channelOptions);
      this.stubs.set(address, stub);
    }
    return stub;
  }

  // ------------------------------------------------------------------------ queries

  /** Admit a query (idempotent on `queryId`: `created` is false when it was known). */
  submit(request: DeepPartial<SubmitQueryRequest>, options?: CallOptions): Promise<SubmitQueryResponse> {
    const message = SubmitQueryRequest.fromPartial(request);
    return this.unary(message.queryId, options, (stub, md, opts, cb) => stub.submitQuery(message, md, opts, cb));
  }

  /** Cancel a query: its waiting calls are dropped, running ones aborted. */
  cancel(queryId: string, options?: CallOptions): Promise<CancelQueryResponse> {
    const message = CancelQueryRequest.fromPartial({ queryId });
    return this.unary(queryId, options, (stub, md, opts, cb) => stub.cancelQuery(message, md, opts, cb));
  }

  /** A query's state, its events and its stages. */
  get(queryId: string, options?: CallOptions): Promise<GetQueryResponse> {
    const message = GetQueryRequest.fromPartial({ queryId });
    return this.unary(queryId, options, (stub, md, opts, cb) => stub.getQuery(message, md, opts, cb));
  }

  /** The cluster: instances and their load, the policy, alpha, the clock. With shards, of the
   * default coordinator (the next one when it does not answer: every coordinator sees every
   * instance). */
  status(options?: CallOptions): Promise<ClusterStatusResponse> {
    const message = ClusterStatusRequest.fromPartial({});
    return this.unary(undefined, options, (stub, md, opts, cb) => stub.clusterStatus(message, md, opts, cb));
  }

  /** Set the dispatcher's alpha (what the tuner does); `reason` is kept in its history. With
   * shards, at the default coordinator (the next one when it does not answer). */
  setAlpha(alpha: number, reason = "", options?: CallOptions): Promise<SetAlphaResponse> {
    const message = SetAlphaRequest.fromPartial({ alpha, reason });
    return this.unary(undefined, options, (stub, md, opts, cb) => stub.setAlpha(message, md, opts, cb));
  }

  /** A query's events, past ones first, until its terminal one (SUCCEEDED, CANCELLED,
   * FAILED), which is the last yielded. */
  async *watch(queryId: string, options?: CallOptions): AsyncGenerator<QueryEvent, void, undefined> {
    const message = WatchQueryRequest.fromPartial({ queryId });
    const stream = this.stream(queryId, options, (stub, md, opts) => stub.watchQuery(message, md, opts));
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
    const stream = this.stream(message.query?.queryId ?? "", options, (stub, md, opts) => stub.runQuery(message, md, opts));
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
    return this.unary(message.workflowId, options, (stub, md, opts, cb) => stub.openWorkflow(message, md, opts, cb));
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
    const stream = this.stream(workflowId, options, (stub, md, opts) => stub.runCall(message, md, opts));
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
    return this.unary(workflowId, options, (stub, md, opts, cb) => stub.closeWorkflow(message, md, opts, cb));
  }

  // ------------------------------------------------------------------------ channel

  /** Resolve once the channel is connected (with several coordinators: one of them); reject
   * (UNAVAILABLE) after `timeoutMs`. */
  async waitForReady(timeoutMs = 10_000): Promise<void> {
    const deadline = Date.now() + timeoutMs;
    const one = (address: string) =>
      new Promise<void>((resolve, reject) =>
        this.stubAt(address).waitForReady(deadline, (error) => (error ? reject(error) : resolve())),
      );
    try {
      await Promise.any(this.router.candidates().map(one));
    } catch (failure) {
      const error = failure instanceof AggregateError ? failure.errors[0] : failure;
      const message = error instanceof Error ? error.message : String(error);
      const who = this.addresses.length === 1 ? "the coordinator" : "any coordinator";
      throw new CoordinatorUnavailableError(
        this.address,
        status.UNAVAILABLE,
        message,
        new Metadata(),
        `cannot reach ${who} at ${this.address} (is \`hexgen-flow up\` running?): ${message}`,
      );
    }
  }

  /** Close the channels; calls in flight are cancelled. */
  close(): void {
    for (const stub of this.stubs.values()) stub.close();
    this.stubs.clear();
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

  /** The error of a call to `address`: a CoordinatorError (UNAVAILABLE `answered` when the
   * channel is connected: the coordinator itself said so); a CANCELLED that the caller did
   * not cause (the coordinator cancelled its calls as it stopped: a restart, a shard handed
   * over) is a CoordinatorUnavailableError, which routing moves on from. */
  private failure(error: unknown, address: string, signal: AbortSignal | undefined): unknown {
    const state = this.stubs.get(address)?.getChannel().getConnectivityState(false);
    const failure = toCoordinatorError(error, address, state === connectivityState.READY);
    if (
      failure instanceof CoordinatorError &&
      !(failure instanceof CoordinatorUnavailableError) &&
      failure.code === status.CANCELLED &&
      !signal?.aborted
    ) {
      return new CoordinatorUnavailableError(address, failure.code, failure.details, failure.metadata);
    }
    return failure;
  }

  /** The error to throw after `error` at `route.address`; undefined when the call is to be
   * sent again, to the route's next address (a redirect, or an address that could not serve). */
  private rerouted(route: Route, error: unknown, signal: AbortSignal | undefined): unknown {
    const failure = this.failure(error, route.address, signal);
    if (!(failure instanceof CoordinatorError) || signal?.aborted) return failure;
    return route.reroute(failure, ownerOf(failure));
  }

  /** `start` sent where the router says for `queryId` (undefined: the default coordinator),
   * again after each redirect or unanswered address, until one answers. */
  private async unary<T>(
    queryId: string | undefined,
    options: CallOptions | undefined,
    start: (
      stub: CoordinatorServiceClient,
      metadata: Metadata,
      callOptions: Partial<GrpcCallOptions>,
      callback: (error: ServiceError | null, response: T) => void,
    ) => ClientUnaryCall,
  ): Promise<T> {
    const route = this.router.route(queryId);
    for (;;) {
      try {
        return await this.unaryAt(route.address, options, start);
      } catch (error) {
        const problem = this.rerouted(route, error, options?.signal);
        if (problem !== undefined) throw problem;
      }
    }
  }

  private unaryAt<T>(
    address: string,
    options: CallOptions | undefined,
    start: (
      stub: CoordinatorServiceClient,
      metadata: Metadata,
      callOptions: Partial<GrpcCallOptions>,
      callback: (error: ServiceError | null, response: T) => void,
    ) => ClientUnaryCall,
  ): Promise<T> {
    return new Promise<T>((resolve, reject) => {
      const signal = options?.signal;
      let call: ClientUnaryCall | undefined;
      const onAbort = () => call?.cancel();
      const stub = this.stubAt(address);
      call = start(stub, this.callMetadata(options), this.callOptions(options, true), (error, response) => {
        signal?.removeEventListener("abort", onAbort);
        if (error) reject(error);
        else resolve(response);
      });
      if (signal?.aborted) call.cancel();
      else signal?.addEventListener("abort", onAbort, { once: true });
    });
  }

  /**
   * The responses of the stream `start` opens, routed as `unary`: a redirect (or an
   * unanswered address) arrives as its error before any response, and the stream is opened
   * again where the route goes next. An error once responses came is thrown as it is
   * (opening it again would repeat them); when the coordinator went away, the router stops
   * preferring it, so that a re-watch finds the shard's successor.
   */
  private async *stream<T>(
    queryId: string,
    options: CallOptions | undefined,
    start: (
      stub: CoordinatorServiceClient,
      metadata: Metadata,
      callOptions: Partial<GrpcCallOptions>,
    ) => ClientReadableStream<T>,
  ): AsyncGenerator<T, void, undefined> {
    const route = this.router.route(queryId);
    const signal = options?.signal;
    for (;;) {
      const address = route.address;
      const call = start(this.stubAt(address), this.callMetadata(options), this.callOptions(options, false));
      // Cancelling a call makes it emit a CANCELLED error; nobody may be listening by then.
      call.on("error", () => {});
      const onAbort = () => call.cancel();
      if (signal?.aborted) call.cancel();
      else signal?.addEventListener("abort", onAbort, { once: true });
      const responses = call[Symbol.asyncIterator]() as AsyncIterator<T>;
      let answered = false;
      try {
        for (;;) {
          let next: IteratorResult<T>;
          try {
            next = await responses.next();
          } catch (error) {
            if (!answered) {
              const problem = this.rerouted(route, error, signal);
              if (problem !== undefined) throw problem;
              break; // sent again, to the route's next address
            }
            const failure = this.failure(error, address, signal);
            // It served this stream and broke it: it went away (or lost its Redis), so a
            // re-watch asks the others before it.
            if (failure instanceof CoordinatorUnavailableError) this.router.wentAway(address);
            throw failure;
          }
          if (next.done) return;
          answered = true;
          yield next.value;
        }
      } finally {
        signal?.removeEventListener("abort", onAbort);
        call.cancel(); // a no-op once the call has ended; stops the stream when left early
      }
    }
  }
}
