// @hexgen-flow/client: a TypeScript client of the HexGen-Flow coordinator (hexgen_flow.v1).
export {
  API_KEY_ENV,
  API_KEY_METADATA,
  CoordinatorClient,
  DEFAULT_COORDINATOR,
  TLS_CA_ENV,
  apiKeyInterceptor,
  TERMINAL_EVENT_KINDS,
  eventKindName,
  isTerminal,
  type CallInput,
  type CallOptions,
  type CoordinatorClientOptions,
} from "./client.js";
export {
  CoordinatorError,
  CoordinatorOverloadedError,
  CoordinatorUnavailableError,
  RETRY_AFTER_KEY,
  ShardRedirectLoopError,
  StatusCode,
  statusName,
} from "./errors.js";
export {
  MAX_REDIRECTS,
  OWNERS_KEPT,
  Route,
  SHARD_OWNER_KEY,
  ShardRouter,
  ownerOf,
  splitAddresses,
} from "./routing.js";

// The API's messages (interfaces, with encode/decode/fromPartial/toJSON companions), enums,
// and the generated grpc-js stub and service definition: everything coordinator.proto
// declares, as src/gen/ has it; the messages of workflow.proto it uses.
export * from "./gen/hexgen_flow/v1/coordinator.js";
export { ChatMessage, LLMCall, Stage, Workflow } from "./gen/hexgen_flow/v1/workflow.js";
