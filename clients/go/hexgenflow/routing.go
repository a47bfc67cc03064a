package hexgenflow

// Which coordinator a query's RPC goes to, learnt from the coordinators' redirects (the Go
// side of clients/python/hexgen_client/routing.py; the same rules and names).
//
// A sharded mesh runs several coordinators, each owning the workflows whose id hashes to
// its shard; any of them answers an RPC about a workflow of another shard with a redirect
// (FAILED_PRECONDITION, the owner's "host:port" in the trailing metadata
// ShardOwnerTrailer), or with UNAVAILABLE while that shard has no coordinator (a
// takeover). The client needs no shard map of its own: a ShardRouter remembers, per query
// id, the owner it was last sent to (a bounded LRU), and otherwise sends to its default
// address. One RPC is one route: it starts there, follows redirects (a few hops; a circle
// is a *ShardRedirectLoopError) and, when an address does not answer, moves on to the next
// configured address not tried yet (which redirects to the current owner), until none is
// left: then an UNAVAILABLE *Error naming every address tried, which callers retry.
//
// With one address nothing changes: no redirect comes, and an unreachable coordinator is
// the same UNAVAILABLE *Error as ever.

import (
	"container/list"
	"errors"
	"fmt"
	"strings"
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
)

// ShardOwnerTrailer is the trailing metadata of a coordinator's redirect
// (FAILED_PRECONDITION): the "host:port" of the coordinator that owns the query's shard.
const ShardOwnerTrailer = "hexgen-shard-owner"

// MaxRedirects is how many redirects one RPC follows: one suffices when the coordinators
// agree, a second covers an owner that changed (a takeover) between two answers.
const MaxRedirects = 3

// OwnersKept is how many query ids' owners a ShardRouter remembers (the most recently used
// ones) unless told otherwise.
const OwnersKept = 10_000

// SplitAddresses is the coordinators' addresses of "host:port", of a comma list
// "host:port,host:port" (a sharded mesh's coordinators), or of several of either: each
// once, in the order given. An error when that leaves none.
func SplitAddresses(addrs ...string) ([]string, error) {
	var found []string
	seen := map[string]bool{}
	for _, piece := range addrs {
		for _, a := range strings.Split(piece, ",") {
			a = strings.TrimSpace(a)
			if a != "" && !seen[a] {
				seen[a] = true
				found = append(found, a)
			}
		}
	}
	if len(found) == 0 {
		return nil, fmt.Errorf("hexgenflow: no coordinator address in %q", strings.Join(addrs, ","))
	}
	return found, nil
}

// ShardOwner is the owner's address a coordinator's redirect names ("" when err is no
// redirect: not a FAILED_PRECONDITION *Error carrying the ShardOwnerTrailer). The client
// follows redirects itself; this is for calls made through Stub().
func ShardOwner(err error) string {
	var e *Error
	if errors.As(err, &e) {
		return e.owner
	}
	return ""
}

// ownerIn is the owner a redirect's trailer names, "" when none.
func ownerIn(code codes.Code, trailer metadata.MD) string {
	if code != codes.FailedPrecondition {
		return ""
	}
	if values := trailer.Get(ShardOwnerTrailer); len(values) > 0 {
		return strings.TrimSpace(values[0])
	}
	return ""
}

// ShardRouter is a client's memory of where queries live: their owners, learnt from
// redirects, and the default address. Safe for concurrent use.
type ShardRouter struct {
	addresses  []string
	ownersKept int

	mu     sync.Mutex
	def    int                      // index of the default address
	owners map[string]*list.Element // query id -> its entry in order
	order  *list.List               // of *ownerEntry, least recently used first
}

type ownerEntry struct{ queryID, owner string }

// NewShardRouter is a router of the coordinators at addresses (at least one; it panics on
// none), tried in that order, remembering the owners of up to ownersKept query ids (0:
// OwnersKept).
func NewShardRouter(addresses []string, ownersKept int) *ShardRouter {
	if len(addresses) == 0 {
		panic("hexgenflow: a router needs at least one address")
	}
	if ownersKept <= 0 {
		ownersKept = OwnersKept
	}
	return &ShardRouter{
		addresses:  append([]string(nil), addresses...),
		ownersKept: ownersKept,
		owners:     map[string]*list.Element{},
		order:      list.New(),
	}
}

// Addresses are the configured coordinators, in the order they are tried.
func (r *ShardRouter) Addresses() []string { return append([]string(nil), r.addresses...) }

// Default is where an RPC goes when no owner is known (and Status, SetAlpha): the first
// configured address, moved on to the next when it stops answering.
func (r *ShardRouter) Default() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.addresses[r.def]
}

// Owner is the address last learnt to own queryID, "" when none was.
func (r *ShardRouter) Owner(queryID string) string {
	r.mu.Lock()
	defer r.mu.Unlock()
	if el, ok := r.owners[queryID]; ok {
		r.order.MoveToBack(el)
		return el.Value.(*ownerEntry).owner
	}
	return ""
}

// Learn remembers owner as queryID's, forgetting the least recently used owners past the
// router's bound.
func (r *ShardRouter) Learn(queryID, owner string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if el, ok := r.owners[queryID]; ok {
		el.Value.(*ownerEntry).owner = owner
		r.order.MoveToBack(el)
	} else {
		r.owners[queryID] = r.order.PushBack(&ownerEntry{queryID, owner})
	}
	for r.order.Len() > r.ownersKept {
		oldest := r.order.Front()
		r.order.Remove(oldest)
		delete(r.owners, oldest.Value.(*ownerEntry).queryID)
	}
}

// WentAway tells the router that nothing answers at address (any more): it is forgotten as
// an owner, so that the next RPC about its queries asks the others (a dead shard's queries
// are taken over at another address), and no longer preferred as the default.
func (r *ShardRouter) WentAway(address string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for el := r.order.Front(); el != nil; {
		next := el.Next()
		if entry := el.Value.(*ownerEntry); entry.owner == address {
			r.order.Remove(el)
			delete(r.owners, entry.queryID)
		}
		el = next
	}
	if r.addresses[r.def] == address {
		r.def = (r.def + 1) % len(r.addresses)
	}
}

// Candidates are the configured addresses from the default on, wrapping around.
func (r *ShardRouter) Candidates() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append(append([]string(nil), r.addresses[r.def:]...), r.addresses[:r.def]...)
}

// route is the route of one RPC about queryID ("": not about a query, no redirect).
func (r *ShardRouter) route(queryID string) *route {
	address := ""
	if queryID != "" {
		address = r.Owner(queryID)
	}
	if address == "" {
		address = r.Default()
	}
	return &route{
		router: r, queryID: queryID, address: address, tried: []string{address},
		redirecting: map[string]bool{}, unavailable: map[string]*Error{},
	}
}

// route is the addresses one RPC tries: address now; reroute after each failure.
type route struct {
	router      *ShardRouter
	queryID     string
	address     string
	tried       []string          // every address the RPC was sent to, in order
	redirecting map[string]bool   // those that answered with a redirect: one named as owner is a circle
	unavailable map[string]*Error // those that could not serve
	notes       []string          // what each address tried said, for the error when none could serve
}

// reroute, after e at address: nil to send the RPC again, to the updated address; else
// the error to return.
func (rt *route) reroute(e *Error) error {
	address := rt.address
	if e.unavailable() {
		if !e.answered {
			rt.router.WentAway(address)
		}
		rt.unavailable[address] = e
		said := "no answer"
		if e.answered {
			said = e.Message
		}
		rt.notes = append(rt.notes, address+": "+said)
		return rt.nextConfigured(e)
	}
	owner := e.owner
	if owner == "" || rt.queryID == "" {
		return e
	}
	rt.notes = append(rt.notes, address+": redirected to "+owner)
	rt.redirecting[address] = true
	if rt.redirecting[owner] || len(rt.redirecting) > MaxRedirects {
		hops := append(append([]string(nil), rt.tried...), owner)
		return &ShardRedirectLoopError{QueryID: rt.queryID, Hops: hops, Last: e}
	}
	if last, ok := rt.unavailable[owner]; ok {
		// The owner named is one that just could not serve (dead, its lease not yet
		// expired): the others may know a successor, else it is worth a retry.
		return rt.nextConfigured(last)
	}
	rt.router.Learn(rt.queryID, owner)
	rt.goTo(owner)
	return nil
}

func (rt *route) goTo(address string) {
	rt.address = address
	rt.tried = append(rt.tried, address)
}

func (rt *route) nextConfigured(last *Error) error {
	for _, address := range rt.router.Candidates() {
		if !contains(rt.tried, address) {
			rt.goTo(address)
			return nil
		}
	}
	if len(rt.tried) == 1 {
		return last // one address, as without shards: its own error, unchanged
	}
	what := "the request"
	if rt.queryID != "" {
		what = "query '" + rt.queryID + "'"
	}
	return &Error{
		Code:    codes.Unavailable,
		Address: strings.Join(rt.tried, ","),
		Message: fmt.Sprintf("no coordinator can serve %s now (%s): are they running? "+
			"(a shard being taken over is served again within seconds)", what, strings.Join(rt.notes, "; ")),
	}
}

func contains(xs []string, s string) bool {
	for _, x := range xs {
		if x == s {
			return true
		}
	}
	return false
}
