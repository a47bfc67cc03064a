// Which coordinator a query's RPC goes to, learnt from the coordinators' redirects (the
// TypeScript side of clients/python/hexgen_client/routing.py; the same rules and names).
//
// A sharded mesh runs several coordinators, each owning the workflows whose id hashes to its
// shard; any of them answers an RPC about a workflow of another shard with a redirect
// (FAILED_PRECONDITION, the owner's "HOST:PORT" in the trailing metadata `SHARD_OWNER_KEY`),
// or with UNAVAILABLE while that shard has no coordinator (a takeover). The client needs no
// shard map of its own: `ShardRouter` remembers, per query id, the owner it was last sent to
// (a bounded LRU), and otherwise sends to its default address. One RPC is one `Route`: it
// starts there, follows redirects (a few hops; a circle is `ShardRedirectLoopError`) and, when
// an address does not answer, moves on to the next configured address not tried yet (which
// redirects to the current owner), until none is left: then `CoordinatorUnavailableError`,
// which callers retry.
//
// With one address nothing changes: no redirect comes, and an unreachable coordinator is the
// same `CoordinatorUnavailableError` as ever.
import { Metadata, status } from "@grpc/grpc-js";

import { CoordinatorError, CoordinatorUnavailableError, ShardRedirectLoopError } from "./errors.js";

/** The trailing metadata of a coordinator's redirect (FAILED_PRECONDITION): the owner's
 * "HOST:PORT". */
export const SHARD_OWNER_KEY = "hexgen-shard-owner";

/** Redirects one RPC follows: one suffices when the coordinators agree, a second covers an
 * owner that changed (a takeover) between two answers. */
export const MAX_REDIRECTS = 3;

/** Query ids whose owner a `ShardRouter` remembers by default (the most recently used ones). */
export const OWNERS_KEPT = 10_000;

/**
 * The addresses of "HOST:PORT", of a comma list "HOST:PORT,HOST:PORT" (a sharded mesh's
 * coordinators), or of an array of either: each once, in the order given. Throws when that
 * leaves none.
 */
export function splitAddresses(addresses: string | readonly string[]): string[] {
  const pieces = typeof addresses === "string" ? [addresses] : addresses;
  const found = pieces.flatMap((piece) => piece.split(",")).map((a) => a.trim()).filter((a) => a !== "");
  if (found.length === 0) throw new Error(`no coordinator address in ${JSON.stringify(addresses)}`);
  return [...new Set(found)];
}

/** The owner's address a redirect names; undefined when `error` is no redirect. */
export function ownerOf(error: unknown): string | undefined {
  if (!(error instanceof CoordinatorError) || error.code !== status.FAILED_PRECONDITION) return undefined;
  const value = error.metadata.get(SHARD_OWNER_KEY)[0];
  const owner = value === undefined ? "" : String(value).trim();
  return owner === "" ? undefined : owner;
}

/** The client's memory of where queries live: their owners, and the default address. */
export class ShardRouter {
  /** The configured coordinators, in the order they are tried. */
  readonly addresses: readonly string[];
  readonly ownersKept: number;
  private defaultIndex = 0;
  /** Query id -> owner, least recently used first. */
  private readonly owners = new Map<string, string>();

  constructor(addresses: readonly string[], options: { ownersKept?: number } = {}) {
    if (addresses.length === 0) throw new Error("a router needs at least one address");
    this.addresses = [...addresses];
    this.ownersKept = options.ownersKept ?? OWNERS_KEPT;
  }

  /** Where an RPC goes when no owner is known (and status, setAlpha): the first configured
   * address, moved on to the next when it stops answering. */
  get default(): string {
    return this.addresses[this.defaultIndex] as string;
  }

  /** The address last learnt to own `queryId`; undefined when none was. */
  owner(queryId: string): string | undefined {
    const owner = this.owners.get(queryId);
    if (owner !== undefined) {
      this.owners.delete(queryId);
      this.owners.set(queryId, owner);
    }
    return owner;
  }

  learn(queryId: string, owner: string): void {
    this.owners.delete(queryId);
    this.owners.set(queryId, owner);
    for (const oldest of this.owners.keys()) {
      if (this.owners.size <= this.ownersKept) break;
      this.owners.delete(oldest);
    }
  }

  /** Nothing answers at `address` (any more): forget it as an owner, so that the next RPC
   * about its queries asks the others (a dead shard's queries are taken over at another
   * address), and no longer prefer it as the default. */
  wentAway(address: string): void {
    for (const [queryId, owner] of [...this.owners]) if (owner === address) this.owners.delete(queryId);
    if (this.default === address) this.defaultIndex = (this.defaultIndex + 1) % this.addresses.length;
  }

  /** The configured addresses from the default on, wrapping around. */
  candidates(): string[] {
    const k = this.defaultIndex;
    return [...this.addresses.slice(k), ...this.addresses.slice(0, k)];
  }

  /** The route of one RPC about `queryId` (undefined: not about a query, no redirect). */
  route(queryId: string | undefined): Route {
    return new Route(this, queryId);
  }
}

/** The addresses one RPC tries: `address` now; `reroute` after each failure. */
export class Route {
  address: string;
  /** Every address the RPC was sent to, in order. */
  private readonly tried: string[];
  /** The addresses that answered with a redirect: one named as owner is a circle. */
  private readonly redirecting = new Set<string>();
  private readonly unavailable = new Map<string, CoordinatorUnavailableError>();
  /** What each address tried said, for the error when none could serve. */
  private readonly notes: string[] = [];

  constructor(
    readonly router: ShardRouter,
    readonly queryId: string | undefined,
  ) {
    const owner = queryId !== undefined ? router.owner(queryId) : undefined;
    this.address = owner ?? router.default;
    this.tried = [this.address];
  }

  /** After `error` at `address` (`owner`: the owner its redirect names): undefined to send
   * the RPC again, to the updated `address`; else the error to throw. */
  reroute(error: CoordinatorError, owner: string | undefined): CoordinatorError | undefined {
    const address = this.address;
    if (error instanceof CoordinatorUnavailableError) {
      if (!error.answered) this.router.wentAway(address);
      this.unavailable.set(address, error);
      this.notes.push(`${address}: ${error.answered ? error.details : "no answer"}`);
      return this.nextConfigured(error);
    }
    if (owner === undefined || this.queryId === undefined) return error;
    this.notes.push(`${address}: redirected to ${owner}`);
    this.redirecting.add(address);
    if (this.redirecting.has(owner) || this.redirecting.size > MAX_REDIRECTS) {
      return new ShardRedirectLoopError(this.queryId, [...this.tried, owner], error.details, error.metadata);
    }
    const down = this.unavailable.get(owner);
    // The owner named is one that just could not serve (dead, its lease not yet expired):
    // the others may know a successor, else it is worth a retry.
    if (down !== undefined) return this.nextConfigured(down);
    this.router.learn(this.queryId, owner);
    this.go(owner);
    return undefined;
  }

  private go(address: string): void {
    this.address = address;
    this.tried.push(address);
  }

  private nextConfigured(last: CoordinatorUnavailableError): CoordinatorError | undefined {
    for (const address of this.router.candidates()) {
      if (!this.tried.includes(address)) {
        this.go(address);
        return undefined;
      }
    }
    if (this.tried.length === 1) return last; // one address, as without shards: its own error
    const what = this.queryId !== undefined ? `query '${this.queryId}'` : "the request";
    return new CoordinatorUnavailableError(
      this.tried.join(","),
      status.UNAVAILABLE,
      last.details,
      new Metadata(),
      `no coordinator can serve ${what} now (${this.notes.join("; ")}): are they running? ` +
        "(a shard being taken over is served again within seconds)",
    );
  }
}
